//! `sanfs-agent quickstart MOUNTPOINT`: a whole sanfs on one machine, for trying it. As root it
//! makes four file-backed LUNs (loop devices with `--direct-io=on` when it can, else the
//! files), formats a 4-LUN striped volume with `sanfs-mds format`, starts `sanfs-mds serve` as
//! a daemon (ready when it says `READY=1` on a notify socket, as under systemd), starts an
//! agent and mounts the file system at MOUNTPOINT.
//!
//! Everything it makes is written to a state file (`STATE_DIR/state.json`) as soon as it
//! exists: LUN files, loop devices (with their backing file), processes (pid and start time,
//! so a reused pid is never signalled), the mount, and whether it made the mount point.
//! `quickstart --down MOUNTPOINT` undoes exactly those and nothing else; a failed start undoes
//! what it had made the same way.

use std::io::Write;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::control;
use crate::mount_helper;
use crate::mount_options::LogTarget;

/// The state file's name in the state directory.
pub const STATE_FILE: &str = "state.json";
/// How many LUNs the quickstart volume has.
pub const LUNS: usize = 4;

/// What `quickstart` is asked to do.
#[derive(Debug, Clone)]
pub struct Options {
    pub mountpoint: PathBuf,
    /// Holds the LUN files, the metadata store, the logs and the state file.
    pub state_dir: PathBuf,
    /// The server's gRPC port on 127.0.0.1.
    pub port: u16,
    /// The server's metrics port on 127.0.0.1.
    pub metrics_port: u16,
    /// Bytes per LUN (sparse files).
    pub lun_size: u64,
    /// `sanfs-mds`; `None`: next to this executable, else on PATH.
    pub mds: Option<PathBuf>,
}

/// A process quickstart started.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Proc {
    pub pid: u32,
    /// Field 22 of `/proc/PID/stat`: tells this process from a later one with its pid.
    pub start_time: u64,
}

/// A loop device quickstart attached.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LoopDevice {
    pub device: PathBuf,
    pub file: PathBuf,
}

/// Everything one quickstart made.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    pub state_dir: PathBuf,
    pub mountpoint: PathBuf,
    pub made_mountpoint: bool,
    pub lun_files: Vec<PathBuf>,
    pub loop_devices: Vec<LoopDevice>,
    pub server: Option<Proc>,
    pub agent: Option<Proc>,
    pub mounted: bool,
    pub port: u16,
    pub metrics_port: u16,
}

/// `println!` that does not panic when stdout went away (`quickstart | head`): what was made is
/// in the state file either way.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

fn say(msg: impl std::fmt::Display) {
    outln!("==> {msg}");
}

impl State {
    fn path(dir: &Path) -> PathBuf {
        dir.join(STATE_FILE)
    }

    /// Writes the state file (write a temporary, then rename).
    fn save(&self) -> anyhow::Result<()> {
        let path = State::path(&self.state_dir);
        let tmp = path.with_extension("json.tmp");
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("write {}", tmp.display()))?;
        f.write_all(serde_json::to_string_pretty(self)?.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path).with_context(|| format!("write {}", path.display()))
    }

    /// Reads the state file of `dir`, `None` when there is none.
    pub fn load(dir: &Path) -> anyhow::Result<Option<State>> {
        let path = State::path(dir);
        match std::fs::read(&path) {
            Ok(b) => Ok(Some(serde_json::from_slice(&b).with_context(|| {
                format!("{} is not a quickstart state file", path.display())
            })?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
        }
    }
}

/// A process's start time, `None` if it is gone.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; fields after its ')' are plain.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Proc {
    fn of(pid: u32) -> anyhow::Result<Proc> {
        Ok(Proc {
            pid,
            start_time: start_time(pid).with_context(|| format!("process {pid} is gone"))?,
        })
    }

    /// Whether this very process still runs (a zombie counts as gone).
    pub fn alive(&self) -> bool {
        let zombie = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .ok()
            .and_then(|s| {
                s.rfind(')')
                    .map(|i| s[i + 1..].trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        start_time(self.pid) == Some(self.start_time) && !zombie
    }

    fn signal(&self, sig: rustix::process::Signal) {
        if !self.alive() {
            return;
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.pid as i32) {
            let _ = rustix::process::kill_process(pid, sig);
        }
    }

    /// Waits at most `secs` for the process to end.
    fn wait_gone(&self, secs: u64) -> bool {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while self.alive() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        true
    }

    /// SIGTERM, then SIGKILL after `secs`.
    fn stop(&self, what: &str, secs: u64) {
        if !self.alive() {
            return;
        }
        say(format!("stopping {what} (pid {})", self.pid));
        self.signal(rustix::process::Signal::TERM);
        if !self.wait_gone(secs) {
            say(format!("{what} did not stop in {secs} s: killing it"));
            self.signal(rustix::process::Signal::KILL);
            self.wait_gone(5);
        }
    }
}

/// `sanfs-mds` next to this executable, else on PATH.
fn find_mds() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("find this executable")?;
    let mut dirs: Vec<PathBuf> = exe.parent().map(Path::to_path_buf).into_iter().collect();
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    dirs.extend(["/usr/local/bin", "/usr/sbin", "/usr/bin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("sanfs-mds"))
        .find(|p| p.is_file())
        .context(
            "sanfs-mds not found next to sanfs-agent or on PATH (cargo build --release -p sanfs-metadata-server)",
        )
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

fn fuse_mounted(dir: &Path) -> bool {
    control::fuse_mounts().is_ok_and(|m| m.iter().any(|e| e.mount_point == dir))
}

/// Brings a quickstart up (see the module doc). On failure, undoes what it made.
pub fn up(o: &Options) -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "quickstart needs root: it attaches loop devices (losetup) as LUNs and mounts the file system with FUSE (/dev/fuse). Run it as root (e.g. with sudo)."
        );
    }
    if !Path::new("/dev/fuse").exists() {
        bail!("quickstart needs /dev/fuse (modprobe fuse) to mount the file system");
    }
    if let Some(s) = State::load(&o.state_dir)? {
        bail!(
            "a quickstart is already up: mounted at {} (server on 127.0.0.1:{}, state in {}). Use it, or take it down first: sanfs-agent quickstart --down {}",
            s.mountpoint.display(),
            s.port,
            State::path(&s.state_dir).display(),
            s.mountpoint.display()
        );
    }
    if o.state_dir.exists() {
        bail!(
            "{} exists but holds no quickstart state: remove it or choose another --state-dir",
            o.state_dir.display()
        );
    }
    let mds = match &o.mds {
        Some(m) => m.clone(),
        None => find_mds()?,
    };
    if o.lun_size < 64 << 20 {
        bail!("a LUN must have at least 64 MiB");
    }
    let mountpoint = std::path::absolute(&o.mountpoint)
        .with_context(|| format!("mount point {}", o.mountpoint.display()))?;
    if fuse_mounted(&mountpoint) {
        bail!("{} is already a FUSE mount", mountpoint.display());
    }
    if let Some(parent) = o.state_dir.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("make {}", parent.display()))?;
    }
    std::fs::create_dir(&o.state_dir)
        .with_context(|| format!("make the state directory {}", o.state_dir.display()))?;
    let state_dir = std::fs::canonicalize(&o.state_dir)?;
    let mut st = State {
        state_dir: state_dir.clone(),
        mountpoint: mountpoint.clone(),
        port: o.port,
        metrics_port: o.metrics_port,
        ..State::default()
    };
    st.save()?;
    match build(o, &mds, &mut st) {
        Ok(()) => {
            hints(&st, &mds);
            Ok(())
        }
        Err(e) => {
            eprintln!("quickstart failed: {e:#}");
            eprintln!("undoing what it made:");
            teardown(&st);
            Err(e)
        }
    }
}

/// The steps after the state directory exists; each records what it made in `st`.
fn build(o: &Options, mds: &Path, st: &mut State) -> anyhow::Result<()> {
    let dir = st.state_dir.clone();
    if !st.mountpoint.exists() {
        std::fs::create_dir_all(&st.mountpoint)
            .with_context(|| format!("make the mount point {}", st.mountpoint.display()))?;
        st.made_mountpoint = true;
        st.save()?;
    }
    st.mountpoint = std::fs::canonicalize(&st.mountpoint)?;
    st.save()?;
    let mut devices = Vec::new();
    let mut use_loops = true;
    for i in 0..LUNS {
        let file = dir.join(format!("lun{i}.img"));
        std::fs::File::create(&file)
            .and_then(|f| f.set_len(o.lun_size))
            .with_context(|| format!("make the LUN file {}", file.display()))?;
        st.lun_files.push(file.clone());
        st.save()?;
        if use_loops {
            match attach_loop(&file) {
                Ok(dev) => {
                    st.loop_devices.push(LoopDevice {
                        device: dev.clone(),
                        file: file.clone(),
                    });
                    st.save()?;
                    devices.push(dev);
                    continue;
                }
                Err(e) if i == 0 => {
                    say(format!(
                        "no loop device ({e:#}): the LUNs are the plain files (same format, no O_DIRECT to a block device)"
                    ));
                    use_loops = false;
                }
                Err(e) => return Err(e),
            }
        }
        devices.push(file);
    }
    say(format!(
        "LUNs: {}",
        devices
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(" ")
    ));

    let config = dir.join("mds.toml");
    let socket = dir.join("mds.sock");
    let list = devices
        .iter()
        .map(|d| format!("{:?}", d.display().to_string()))
        .collect::<Vec<_>>()
        .join(", ");
    std::fs::write(
        &config,
        format!(
            "# Made by sanfs-agent quickstart. The agent connects over the unix socket (same\n\
             # host, checked by its uid); the TCP listener refuses plaintext (no insecure).\n\
             [server]\nlisten = \"127.0.0.1:{}\"\nlisten_unix = {:?}\nmetrics_addr = \"127.0.0.1:{}\"\n[metadata]\npath = {:?}\n[volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = [{list}]\n",
            o.port,
            socket.display().to_string(),
            o.metrics_port,
            dir.join("meta.redb").display().to_string()
        ),
    )
    .context("write mds.toml")?;

    say("formatting a 4-LUN striped volume (64 KiB stripe unit)");
    let out = std::process::Command::new(mds)
        .arg("format")
        .arg("--config")
        .arg(&config)
        .output()
        .with_context(|| format!("run {}", mds.display()))?;
    if !out.status.success() {
        bail!(
            "sanfs-mds format failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }

    let log = dir.join("mds.log");
    say(format!(
        "starting sanfs-mds on 127.0.0.1:{} (log: {})",
        o.port,
        log.display()
    ));
    st.server = Some(start_server(mds, &config, &dir, &log)?);
    st.save()?;

    let agent_log = dir.join("agent.log");
    say(format!(
        "mounting at {} (sanfs-agent, FUSE; log: {})",
        st.mountpoint.display(),
        agent_log.display()
    ));
    let exe = std::env::current_exe().context("find this executable")?;
    let luns = devices
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(":");
    let pid = mount_helper::spawn_agent(
        &exe,
        &format!("unix:{}", socket.display()),
        &st.mountpoint,
        &[format!("devices={luns},client_name=quickstart")],
        &LogTarget::File(agent_log),
    )?;
    // Recorded at once: even if it dies now, --down finds its mount.
    st.mounted = true;
    st.agent = Proc::of(pid).ok();
    st.save()?;
    Ok(())
}

fn attach_loop(file: &Path) -> anyhow::Result<PathBuf> {
    let out = std::process::Command::new("losetup")
        .args(["-f", "--show", "--direct-io=on"])
        .arg(file)
        .output()
        .context("run losetup")?;
    if !out.status.success() {
        bail!("losetup: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !dev.starts_with("/dev/loop") {
        bail!("losetup said {dev:?}");
    }
    Ok(PathBuf::from(dev))
}

/// The file behind a loop device now, from sysfs.
fn loop_backing_file(dev: &Path) -> Option<PathBuf> {
    let name = dev.file_name()?.to_str()?;
    let s = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(s.trim_end()))
}

/// Starts `sanfs-mds serve` in a process group of its own, logging to `log`, and waits for its
/// `READY=1` on a notify socket in `dir`.
fn start_server(mds: &Path, config: &Path, dir: &Path, log: &Path) -> anyhow::Result<Proc> {
    use std::os::unix::process::CommandExt;
    let notify_path = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).context("bind the notify socket")?;
    notify.set_read_timeout(Some(Duration::from_millis(200)))?;
    let out = std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    let mut child = std::process::Command::new(mds)
        .arg("serve")
        .arg("--config")
        .arg(config)
        .env("NOTIFY_SOCKET", &notify_path)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_owned()),
        )
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0)
        .spawn()
        .with_context(|| format!("start {}", mds.display()))?;
    let proc_ = Proc::of(child.id())?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = [0u8; 256];
    let ready = loop {
        match notify.recv(&mut buf) {
            Ok(n) if buf[..n].split(|b| *b == b'\n').any(|l| l == b"READY=1") => break Ok(()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => break Err(anyhow::Error::new(e).context("read the notify socket")),
        }
        if let Some(status) = child.try_wait()? {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            break Err(anyhow::anyhow!(
                "sanfs-mds exited ({status}) before serving:\n{}",
                text.lines()
                    .rev()
                    .take(10)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n")
            ));
        }
        if Instant::now() >= deadline {
            break Err(anyhow::anyhow!(
                "sanfs-mds did not become ready within 30 s"
            ));
        }
    };
    let _ = std::fs::remove_file(&notify_path);
    match ready {
        Ok(()) => Ok(proc_),
        Err(e) => {
            proc_.stop("sanfs-mds", 5);
            let _ = child.wait();
            Err(e)
        }
    }
}

fn hints(st: &State, mds: &Path) {
    // The commands as this machine finds them (target/release is not on a user's PATH).
    let agent = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "sanfs-agent".to_owned());
    let bench = Path::new(&agent).with_file_name("sanfs-bench");
    let bench = if bench.is_file() {
        bench.display().to_string()
    } else {
        "sanfs-bench".to_owned()
    };
    let mds = mds.display();
    let mp = st.mountpoint.display();
    let devs: Vec<String> = if st.loop_devices.is_empty() {
        st.lun_files
            .iter()
            .map(|f| f.display().to_string())
            .collect()
    } else {
        st.loop_devices
            .iter()
            .map(|l| l.device.display().to_string())
            .collect()
    };
    let dir = st.state_dir.display();
    outln!(
        "\nsanfs is up: metadata server on 127.0.0.1:{}, LUNs {}, mounted at {mp}.",
        st.port,
        devs.join(" ")
    );
    let block = |title: &str, lines: &[(String, &str)]| {
        let width = lines.iter().map(|(c, _)| c.len()).max().unwrap_or(0);
        outln!("{title}");
        for (cmd, why) in lines {
            outln!("  {cmd:<width$}   # {why}");
        }
    };
    block(
        "Try:",
        &[
            (
                format!("dd if=/dev/urandom of={mp}/big bs=1M count=256"),
                "direct path: striped over the 4 LUNs",
            ),
            (
                format!("{agent} bmap {mp}/big"),
                "where its bytes are: one line per LUN piece",
            ),
            (
                format!("echo hello > {mp}/small; cat {mp}/small"),
                "small I/O: the proxied path",
            ),
            (
                format!("{agent} status {mp}"),
                "the agent: session, LUNs, bytes direct and proxied",
            ),
            (format!("df -h {mp}; ls -la {mp}"), "plain POSIX"),
        ],
    );
    block(
        "Also:",
        &[
            (
                format!(
                    "{mds} volume inspect {}",
                    devs.first().map(String::as_str).unwrap_or("")
                ),
                "a LUN's label",
            ),
            (
                format!("{bench} metadata-grpc --callers 16 --files 300"),
                "metadata ops/s through gRPC",
            ),
            (
                format!("curl -s http://127.0.0.1:{}/metrics", st.metrics_port),
                "the server's Prometheus metrics",
            ),
            (format!("tail -f {dir}/mds.log {dir}/agent.log"), "the logs"),
        ],
    );
    outln!(
        "When done (unmounts, stops both, removes what it made, listed in {dir}/{STATE_FILE}):\n  {agent} quickstart --down {mp} --state-dir {dir}"
    );
}

/// `quickstart --down MOUNTPOINT`: undoes the quickstart whose state is in `state_dir`.
pub fn down(mountpoint: &Path, state_dir: &Path) -> anyhow::Result<()> {
    if !is_root() {
        bail!("quickstart --down needs root (unmount, losetup -d)");
    }
    let Some(st) = State::load(state_dir)? else {
        bail!(
            "no quickstart state in {}: nothing to take down (was it started with another --state-dir?)",
            State::path(state_dir).display()
        );
    };
    let want = std::path::absolute(mountpoint)?;
    let want = std::fs::canonicalize(&want).unwrap_or(want);
    if want != st.mountpoint {
        bail!(
            "the quickstart in {} is mounted at {}, not {}",
            state_dir.display(),
            st.mountpoint.display(),
            want.display()
        );
    }
    if teardown(&st) {
        say("down: everything quickstart made is gone");
        Ok(())
    } else {
        bail!(
            "some of what quickstart made could not be removed (see above); its state stays in {}",
            State::path(state_dir).display()
        )
    }
}

/// Undoes what `st` lists, in reverse order of making. Returns whether all of it went; keeps
/// the state directory (and file) otherwise.
fn teardown(st: &State) -> bool {
    let mut ok = true;
    if st.mounted && fuse_mounted(&st.mountpoint) {
        say(format!("unmounting {}", st.mountpoint.display()));
        if let Err(e) = rustix::mount::unmount(&st.mountpoint, rustix::mount::UnmountFlags::empty())
        {
            say(format!("unmount: {e}; detaching it lazily (busy)"));
            if let Err(e) =
                rustix::mount::unmount(&st.mountpoint, rustix::mount::UnmountFlags::DETACH)
            {
                eprintln!("cannot unmount {}: {e}", st.mountpoint.display());
                ok = false;
            }
        }
    }
    if let Some(agent) = st.agent {
        // It exits by itself once unmounted.
        if !agent.wait_gone(10) {
            agent.stop("sanfs-agent", 10);
        }
        if agent.alive() {
            eprintln!("sanfs-agent (pid {}) is still running", agent.pid);
            ok = false;
        }
    }
    if let Some(server) = st.server {
        server.stop("sanfs-mds", 15);
        if server.alive() {
            eprintln!("sanfs-mds (pid {}) is still running", server.pid);
            ok = false;
        }
    }
    for l in st.loop_devices.iter().rev() {
        match loop_backing_file(&l.device) {
            Some(f) if f == l.file => {
                say(format!("detaching {}", l.device.display()));
                let detached = std::process::Command::new("losetup")
                    .arg("-d")
                    .arg(&l.device)
                    .status()
                    .is_ok_and(|s| s.success());
                if !detached {
                    eprintln!("could not detach {}", l.device.display());
                    ok = false;
                }
            }
            // Detached already, or reused for someone else's file: not ours to touch.
            _ => {}
        }
    }
    if !ok {
        return false;
    }
    for f in &st.lun_files {
        let _ = std::fs::remove_file(f);
    }
    say(format!("removing {}", st.state_dir.display()));
    if let Err(e) = std::fs::remove_dir_all(&st.state_dir) {
        eprintln!("could not remove {}: {e}", st.state_dir.display());
        return false;
    }
    if st.made_mountpoint
        && let Err(e) = std::fs::remove_dir(&st.mountpoint)
    {
        eprintln!(
            "could not remove the mount point {} it made: {e}",
            st.mountpoint.display()
        );
        return false;
    }
    true
}
