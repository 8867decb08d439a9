//! The NFS row of figure 6: a real NFS server (nfs-ganesha with its VFS backend) exporting a
//! local file system made on a LUN equal to sanfs' (a loop device with direct I/O), read and
//! written over TCP with libnfs, the user-space NFS client library, all inside a network
//! namespace of the bench's own.
//!
//! rpcbind and ganesha run in that namespace and in a private mount namespace whose `/run`
//! is a fresh tmpfs, so their sockets and lock files never meet another rpcbind on the
//! machine; both are stopped by their own process ids. libnfs is loaded at run time
//! (`dlopen`), so the bench builds without it and says what to install when it is missing.
//! The client runs on a thread that lives in the namespace; the bench sends it one run at a
//! time.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sanfs_testcluster::{ChildGuard, LunKind, Luns, Netns};

use crate::io::{Op, Sample};
use crate::util::{Budget, pattern, which};

/// The Debian packages the NFS row needs.
pub const PACKAGES: &str = "nfs-ganesha nfs-ganesha-vfs rpcbind libnfs-utils";

/// Why the NFS row cannot run here, or `None` if it can (root, the programs, libnfs).
pub fn unavailable() -> Option<String> {
    if !sanfs_testcluster::is_root() {
        return Some("needs root (loop device, mount, network namespace)".into());
    }
    let mut missing = Vec::new();
    for (bin, pkg) in [
        ("ganesha.nfsd", "nfs-ganesha"),
        ("rpcbind", "rpcbind"),
        ("mkfs.ext4", "e2fsprogs"),
        ("nsenter", "util-linux"),
        ("unshare", "util-linux"),
    ] {
        if which(bin).is_none() {
            missing.push(pkg);
        }
    }
    if !Path::new("/usr/lib/x86_64-linux-gnu/ganesha/libfsalvfs.so").exists()
        && !Path::new("/usr/lib/ganesha/libfsalvfs.so").exists()
        && !Path::new("/usr/lib64/ganesha/libfsalvfs.so").exists()
    {
        missing.push("nfs-ganesha-vfs");
    }
    if LibNfs::load().is_err() {
        missing.push("libnfs-utils (libnfs13)");
    }
    if missing.is_empty() {
        None
    } else {
        Some(format!(
            "missing {}: apt-get install {PACKAGES}",
            missing.join(", ")
        ))
    }
}

type Ctx = *mut c_void;
type Fh = *mut c_void;

/// The few libnfs (4.x/5.x sync API) functions the bench calls.
struct LibNfs {
    _handle: *mut c_void,
    init_context: unsafe extern "C" fn() -> Ctx,
    destroy_context: unsafe extern "C" fn(Ctx),
    mount: unsafe extern "C" fn(Ctx, *const c_char, *const c_char) -> c_int,
    get_error: unsafe extern "C" fn(Ctx) -> *mut c_char,
    open: unsafe extern "C" fn(Ctx, *const c_char, c_int, *mut Fh) -> c_int,
    close: unsafe extern "C" fn(Ctx, Fh) -> c_int,
    pread: unsafe extern "C" fn(Ctx, Fh, u64, u64, *mut c_void) -> c_int,
    pwrite: unsafe extern "C" fn(Ctx, Fh, u64, u64, *const c_void) -> c_int,
    fsync: unsafe extern "C" fn(Ctx, Fh) -> c_int,
    get_readmax: unsafe extern "C" fn(Ctx) -> u64,
    get_writemax: unsafe extern "C" fn(Ctx) -> u64,
}

/// Looks up `name` in `handle` as a function of type `T`.
///
/// # Safety
/// `T` must be the function's true C signature.
unsafe fn symbol<T: Copy>(handle: *mut c_void, name: &str) -> anyhow::Result<T> {
    let cname = CString::new(name)?;
    // SAFETY: `handle` came from a successful dlopen and `cname` is NUL-terminated.
    let p = unsafe { libc::dlsym(handle, cname.as_ptr()) };
    if p.is_null() {
        bail!("libnfs has no {name}");
    }
    debug_assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller promises that `T` is the symbol's function-pointer type, and a
    // function pointer has the size of a data pointer on every platform the bench runs on.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

impl LibNfs {
    /// Loads libnfs 4.x (`libnfs.so.13`) or 5.x (`libnfs.so.14`), whose sync `nfs_pread`
    /// and `nfs_pwrite` take `(offset, count, buf)`; later versions changed that order.
    fn load() -> anyhow::Result<LibNfs> {
        let mut handle = std::ptr::null_mut();
        for name in ["libnfs.so.13", "libnfs.so.14"] {
            let c = CString::new(name)?;
            // SAFETY: a NUL-terminated library name; loading libnfs runs no code of ours.
            handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if !handle.is_null() {
                break;
            }
        }
        if handle.is_null() {
            bail!("libnfs.so.13 or .14 not found");
        }
        // SAFETY: each type below is the C prototype of that name in libnfs 4.x/5.x's
        // <nfsc/libnfs.h>.
        unsafe {
            Ok(LibNfs {
                _handle: handle,
                init_context: symbol(handle, "nfs_init_context")?,
                destroy_context: symbol(handle, "nfs_destroy_context")?,
                mount: symbol(handle, "nfs_mount")?,
                get_error: symbol(handle, "nfs_get_error")?,
                open: symbol(handle, "nfs_open")?,
                close: symbol(handle, "nfs_close")?,
                pread: symbol(handle, "nfs_pread")?,
                pwrite: symbol(handle, "nfs_pwrite")?,
                fsync: symbol(handle, "nfs_fsync")?,
                get_readmax: symbol(handle, "nfs_get_readmax")?,
                get_writemax: symbol(handle, "nfs_get_writemax")?,
            })
        }
    }
}

/// An open NFS file: a libnfs context, mounted, and a handle. Lives on one thread.
struct NfsFile {
    lib: LibNfs,
    ctx: Ctx,
    fh: Fh,
    len: u64,
}

impl NfsFile {
    fn error(&self) -> String {
        // SAFETY: `ctx` is a live context; the returned string (or NULL) is owned by it.
        let p = unsafe { (self.lib.get_error)(self.ctx) };
        if p.is_null() {
            return "unknown error".into();
        }
        // SAFETY: libnfs returns a NUL-terminated string that lives as long as the context.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn open(server: &str, export: &str, path: &str, len: u64) -> anyhow::Result<NfsFile> {
        let lib = LibNfs::load()?;
        // SAFETY: no arguments; returns NULL or a new context that we own.
        let ctx = unsafe { (lib.init_context)() };
        if ctx.is_null() {
            bail!("nfs_init_context failed");
        }
        let mut f = NfsFile {
            lib,
            ctx,
            fh: std::ptr::null_mut(),
            len,
        };
        let (s, e, p) = (
            CString::new(server)?,
            CString::new(export)?,
            CString::new(path)?,
        );
        // SAFETY: a live context and NUL-terminated strings that outlive the call.
        if unsafe { (f.lib.mount)(f.ctx, s.as_ptr(), e.as_ptr()) } != 0 {
            bail!("nfs_mount {server}:{export}: {}", f.error());
        }
        let mut fh: Fh = std::ptr::null_mut();
        // SAFETY: as above; `fh` receives a handle owned by the context.
        if unsafe { (f.lib.open)(f.ctx, p.as_ptr(), libc::O_RDWR, &mut fh) } != 0 {
            bail!("nfs_open {path}: {}", f.error());
        }
        f.fh = fh;
        Ok(f)
    }

    /// At every wrap to the start of the file the server's copy must come from (or reach)
    /// its disk again, as every pass of the other rows does: reads drop the server's page
    /// cache of the file (`host_file`, the same machine), writes commit (`nfs_fsync`).
    fn run(&self, op: Op, size: u64, budget: Budget, host_file: &Path) -> anyhow::Result<Sample> {
        let slots = self.len / size.max(1);
        if slots == 0 {
            bail!("I/O size {size} does not fit the NFS file");
        }
        let mut buf = pattern(size as usize, size ^ 0x33);
        let started = Instant::now();
        let mut ops = 0u64;
        while !budget.done(ops, started) {
            let off = (ops % slots) * size;
            if off == 0 {
                self.start_pass(op, host_file)?;
            }
            // SAFETY: a live context and handle; `buf` holds `size` bytes for the call.
            let n = unsafe {
                match op {
                    Op::Read => {
                        (self.lib.pread)(self.ctx, self.fh, off, size, buf.as_mut_ptr().cast())
                    }
                    Op::Write => {
                        (self.lib.pwrite)(self.ctx, self.fh, off, size, buf.as_ptr().cast())
                    }
                }
            };
            if n < 0 || n as u64 != size {
                bail!(
                    "nfs {} of {size} at {off}: {n} ({})",
                    op.name(),
                    self.error()
                );
            }
            ops += 1;
        }
        if op == Op::Write {
            // The data is on the server's disk before the clock stops (COMMIT).
            // SAFETY: a live context and handle.
            if unsafe { (self.lib.fsync)(self.ctx, self.fh) } != 0 {
                bail!("nfs fsync: {}", self.error());
            }
        }
        let secs = started.elapsed().as_secs_f64();
        Ok(Sample::new(ops, ops * size, secs))
    }

    fn start_pass(&self, op: Op, host_file: &Path) -> anyhow::Result<()> {
        match op {
            Op::Read => {
                let f = std::fs::File::open(host_file)?;
                rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed)?;
            }
            Op::Write => {
                // SAFETY: a live context and handle.
                if unsafe { (self.lib.fsync)(self.ctx, self.fh) } != 0 {
                    bail!("nfs fsync: {}", self.error());
                }
            }
        }
        Ok(())
    }

    fn max_sizes(&self) -> (u64, u64) {
        // SAFETY: a live, mounted context.
        unsafe {
            (
                (self.lib.get_readmax)(self.ctx),
                (self.lib.get_writemax)(self.ctx),
            )
        }
    }
}

impl Drop for NfsFile {
    fn drop(&mut self) {
        // SAFETY: the handle and context are live and used by nobody else; each is freed once.
        unsafe {
            if !self.fh.is_null() {
                (self.lib.close)(self.ctx, self.fh);
            }
            (self.lib.destroy_context)(self.ctx);
        }
    }
}

type Job = (Op, u64, Budget, mpsc::Sender<anyhow::Result<Sample>>);

/// A running NFS server and the client thread that measures against it. Everything is
/// stopped and removed on drop.
pub struct NfsBench {
    jobs: Option<mpsc::Sender<Job>>,
    client: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
    /// rsize / wsize the client negotiated.
    pub readmax: u64,
    pub writemax: u64,
    pub fs: &'static str,
    host_file: PathBuf,
    rpcbind_pid_file: PathBuf,
    ganesha: Option<ChildGuard>,
    _netns: Netns,
    mounted: Option<PathBuf>,
    _luns: Luns,
    _dir: tempfile::TempDir,
}

impl NfsBench {
    /// Makes an ext4 file system on a LUN of `lun_size` bytes under `work`, a file of
    /// `file_len` bytes in it, exports it with ganesha and opens it with libnfs.
    pub fn start(work: &Path, lun_size: u64, file_len: u64) -> anyhow::Result<NfsBench> {
        if let Some(why) = unavailable() {
            bail!("{why}");
        }
        let dir = tempfile::Builder::new()
            .prefix("sanfs-bench-nfs-")
            .tempdir_in(work)?;
        let luns = Luns::create(dir.path(), 1, lun_size, LunKind::Loop)?;
        let dev = luns.paths()[0].clone();
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&dev))?;
        let export = dir.path().join("export");
        std::fs::create_dir(&export)?;
        run(Command::new("mount").arg(&dev).arg(&export))?;
        let netns = Netns::create("nfs")?;
        let mut bench = NfsBench {
            jobs: None,
            client: None,
            readmax: 0,
            writemax: 0,
            fs: "ext4",
            host_file: export.join("data"),
            rpcbind_pid_file: dir.path().join("rpcbind.pid"),
            ganesha: None,
            _netns: netns,
            mounted: Some(export.clone()),
            _luns: luns,
            _dir: dir,
        };
        // The file, written and durable on the server's file system.
        {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .mode(0o666)
                .open(&bench.host_file)?;
            let chunk = pattern(1 << 20, 11);
            let mut left = file_len;
            while left > 0 {
                let n = left.min(chunk.len() as u64) as usize;
                f.write_all(&chunk[..n])?;
                left -= n as u64;
            }
            f.sync_all()?;
        }
        let work_dir = bench._dir.path().to_path_buf();
        let conf = work_dir.join("ganesha.conf");
        std::fs::create_dir_all(work_dir.join("recovery"))?;
        std::fs::write(
            &conf,
            format!(
                "NFS_CORE_PARAM {{ Protocols = 3, 4; NFS_Port = 2049; Enable_NLM = false; \
                 Enable_RQUOTA = false; Enable_UDP = false; }}\n\
                 NFSV4 {{ Graceless = true; RecoveryRoot = {:?}; }}\n\
                 EXPORT {{ Export_Id = 1; Path = {:?}; Pseudo = /exp; Access_Type = RW; \
                 Squash = No_Root_Squash; SecType = sys; Protocols = 3, 4; Transports = TCP; \
                 FSAL {{ Name = VFS; }} }}\n",
                work_dir.join("recovery").to_string_lossy(),
                export.to_string_lossy()
            ),
        )?;
        let ganesha = which("ganesha.nfsd").context("ganesha.nfsd")?;
        let rpcbind = which("rpcbind").context("rpcbind")?;
        // A private /run for rpcbind's socket and lock and ganesha's; rpcbind's pid is
        // written down so that it is stopped by its own id.
        let script = format!(
            "mount -t tmpfs sanfs-bench-run /run || exit 1; {rpcbind:?} -f & echo $! > {:?}; \
             sleep 0.3; exec {ganesha:?} -F -f {conf:?} -L {:?} -N NIV_EVENT -p {:?}",
            bench.rpcbind_pid_file,
            work_dir.join("ganesha.log"),
            work_dir.join("ganesha.pid"),
        );
        let mut cmd = bench._netns.command("unshare");
        cmd.args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        bench.ganesha = Some(ChildGuard::spawn(&mut cmd)?);
        // Inside the namespace, on a thread: wait for the server, mount, open, then serve
        // jobs until the sender is dropped.
        let (ready_tx, ready_rx) = mpsc::channel::<anyhow::Result<(u64, u64)>>();
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        // NFSv3 mounts the export by its path (the pseudo path is NFSv4's).
        let export_path = export.to_string_lossy().into_owned();
        let host_file = bench.host_file.clone();
        let client = bench._netns.run_thread("nfs-client", move || {
            let addr = "127.0.0.1:2049".parse()?;
            let deadline = Instant::now() + Duration::from_secs(30);
            let file = loop {
                let tried = crate::cluster::wait_for_tcp(addr, Duration::from_secs(30))
                    .and_then(|()| NfsFile::open("127.0.0.1", &export_path, "/data", file_len));
                match tried {
                    Ok(f) => break f,
                    // ganesha accepts before its exports are ready: retry for a while.
                    Err(e) if Instant::now() >= deadline => {
                        let _ = ready_tx.send(Err(e));
                        return Ok(());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            };
            let _ = ready_tx.send(Ok(file.max_sizes()));
            while let Ok((op, size, budget, reply)) = jobs_rx.recv() {
                let _ = reply.send(file.run(op, size, budget, &host_file));
            }
            Ok(())
        })?;
        bench.client = Some(client);
        bench.jobs = Some(jobs_tx);
        match ready_rx.recv_timeout(Duration::from_secs(40)) {
            Ok(Ok((r, w))) => {
                bench.readmax = r;
                bench.writemax = w;
            }
            Ok(Err(e)) => {
                return Err(e.context(format!(
                    "mount the ganesha export (log: {})",
                    tail(&work_dir.join("ganesha.log"))
                )));
            }
            Err(_) => bail!("the NFS client did not start in 40 s"),
        }
        Ok(bench)
    }

    /// The server's processes (ganesha), for the row's CPU time; the client runs in this
    /// process.
    pub fn pids(&self) -> Vec<u32> {
        self.ganesha.iter().map(|g| g.pid()).collect()
    }

    /// Runs `op` of `size` bytes on the NFS file. Every pass over the file reads it from
    /// the server's disk (its page cache of the file dropped first) or ends with a COMMIT,
    /// as sanfs' passes do.
    pub fn run(&self, op: Op, size: u64, budget: Budget) -> anyhow::Result<Sample> {
        let (tx, rx) = mpsc::channel();
        self.jobs
            .as_ref()
            .context("the NFS client stopped")?
            .send((op, size, budget, tx))
            .map_err(|_| anyhow::anyhow!("the NFS client stopped"))?;
        rx.recv().context("the NFS client stopped")?
    }
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().rev().take(5).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl Drop for NfsBench {
    fn drop(&mut self) {
        // The client first (it holds the mount), then ganesha, then rpcbind, by their pids.
        self.jobs.take();
        if let Some(c) = self.client.take() {
            let _ = c.join();
        }
        if let Some(mut g) = self.ganesha.take() {
            let _ = g.terminate(Duration::from_secs(10));
        }
        if let Some(pid) = std::fs::read_to_string(&self.rpcbind_pid_file)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            for _ in 0..50 {
                if rustix::process::test_kill_process(pid).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
        if let Some(m) = self.mounted.take() {
            let _ = rustix::mount::unmount(&m, rustix::mount::UnmountFlags::empty())
                .or_else(|_| rustix::mount::unmount(&m, rustix::mount::UnmountFlags::DETACH));
        }
    }
}
