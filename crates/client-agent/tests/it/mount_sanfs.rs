//! `mount.sanfs` through the real mount(8): `mount -t sanfs` with agent options (threshold,
//! attr_ttl, log), sloppy and bad options, `-o remount` (also without `-t`, as pjdfstest does:
//! the mount's type is `fuse.sanfs`, so mount(8) runs our `mount.fuse.sanfs`), a private fstab (`mount --fstab FILE`,
//! `mount -a -t sanfs -O _netdev`), `umount` (every agent exits 0), and `kill -9` of an agent
//! (ENOTCONN, then `umount` and `umount -l` work).
//!
//! Root only. The helpers must be `/sbin/mount.sanfs` and `/sbin/mount.fuse.sanfs` for
//! mount(8) to find them: the scenario runs in a private mount namespace (`unshare -m`) where
//! an overlay on /usr/sbin adds them, so
//! the machine's /sbin and /etc/fstab are never touched. This test process is made a child
//! subreaper so that the daemonised agents become its children and their exit status can be
//! checked.

use std::os::unix::fs::symlink;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::cluster;
use crate::mount::can_mount;

/// Runs `cmd` to completion, killing it after `secs`.
pub(crate) fn run_timeout(cmd: &mut Command, secs: u64) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{cmd:?} did not finish within {secs} s");
        }
    }
}

/// Waits (at most `secs`) for our child `pid` to end; its raw wait status.
fn reap(pid: i32, secs: u64) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let mut status = 0;
        // SAFETY: waitpid on one pid with a valid pointer to an int.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Some(status);
        }
        if r < 0 || Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

const SCENARIO: &str = r#"
set -euo pipefail
fail() { echo "FAIL: $*" >&2; exit 1; }
mounted() { grep -q " $1 " /proc/self/mountinfo; }
mkdir -p "$T/ovl" "$T/a" "$T/b" "$T/c" "$T/d" "$T/k1" "$T/k2"
mount -t tmpfs tmpfs "$T/ovl"
mkdir "$T/ovl/up" "$T/ovl/work"
ln -s "$AGENT" "$T/ovl/up/mount.sanfs"
ln -s "$AGENT" "$T/ovl/up/mount.fuse.sanfs"
mount -t overlay overlay -o "lowerdir=/usr/sbin,upperdir=$T/ovl/up,workdir=$T/ovl/work" /usr/sbin
pid_of() { "$AGENT" status "$1" --json | sed -n 's/^  "pid": \([0-9]*\),*$/\1/p'; }
bytes() { "$AGENT" status "$1" --json | sed -n "s/.*\"$2\": \([0-9]*\).*/\1/p"; }

# 1. mount -t sanfs with agent options; a threshold of 2 MiB sends 1 MiB writes proxied.
mount -t sanfs "$ADDR:/" "$T/a" -o "devices=$LUNS,threshold=2M,attr_ttl=1s,log=$T/a.log"
echo "PID=$(pid_of "$T/a")"
head -c 3000000 /dev/urandom > "$T/src"
cp "$T/src" "$T/a/f"
cmp "$T/src" "$T/a/f"
dd if="$T/src" of="$T/a/g" bs=1M count=2 oflag=direct status=none
[ "$(bytes "$T/a" direct_write)" = 0 ] || fail "threshold=2M: a 1 MiB write went direct"
[ "$(bytes "$T/a" proxied_write)" -ge 2097152 ] || fail "threshold=2M: nothing proxied"
grep -q "INFO sanfs_agent: mounted" "$T/a.log" || fail "no levelled log in $T/a.log"

# 2. a bad option: a clear message, status 1, nothing mounted
set +e; mount -t sanfs "$ADDR:/" "$T/b" -o threshold=lots 2> "$T/err"; rc=$?; set -e
[ "$rc" = 1 ] || fail "threshold=lots: status $rc"
grep -q 'threshold=lots: bad direct-I/O threshold' "$T/err" || fail "message: $(cat "$T/err")"
set +e; mount -t sanfs "$ADDR:/" "$T/b" -o "devices=$LUNS,vers=4" 2> "$T/err"; rc=$?; set -e
[ "$rc" = 1 ] || fail "unknown option: status $rc"
grep -q 'unknown mount option "vers"' "$T/err" || fail "message: $(cat "$T/err")"
mounted "$T/b" && fail "mounted after an error"

# 3. sloppy (-s): the unknown option is reported and skipped
mount -s -t sanfs "$ADDR:/" "$T/b" -o "devices=$LUNS,vers=4,log=$T/b.log" 2> "$T/err"
grep -q 'ignoring unknown option "vers=4"' "$T/err" || fail "sloppy: $(cat "$T/err")"
echo "PID=$(pid_of "$T/b")"
cmp "$T/src" "$T/b/f"

# 4. remount: ro and rw change live; anything else is refused and changes nothing
mount -t sanfs -o remount,ro "$ADDR:/" "$T/a"
if echo no 2> /dev/null > "$T/a/ro"; then fail "wrote on a read-only remount"; fi
mount -t sanfs -o remount,rw "$ADDR:/" "$T/a"
echo yes > "$T/a/rw"
set +e; mount -t sanfs -o remount,attr_ttl=0 "$ADDR:/" "$T/a" 2> "$T/err"; rc=$?; set -e
[ "$rc" = 32 ] || fail "remount,attr_ttl=0: status $rc"
grep -q 'remount can change only ro/rw' "$T/err" || fail "message: $(cat "$T/err")"
echo again >> "$T/a/rw"
# without -t, as pjdfstest does: the mount's type is fuse.sanfs, so mount(8) runs
# mount.fuse.sanfs (ours), not fuse3's mount.fuse; writes are refused with EROFS while ro
awk -v m="$T/a" '$5 == m { split($0, p, " - "); split(p[2], f, " "); print f[1] }' \
  /proc/self/mountinfo > "$T/fstype"
[ "$(cat "$T/fstype")" = fuse.sanfs ] || fail "mount type $(cat "$T/fstype"), want fuse.sanfs"
mount -o remount,ro "$T/a"
set +e; err=$(touch "$T/a/ro2" 2>&1); rc=$?; set -e
[ "$rc" != 0 ] || fail "wrote on a read-only remount without -t"
echo "$err" | grep -q 'Read-only file system' || fail "not EROFS: $err"
mount -o remount,rw "$T/a"
echo third >> "$T/a/rw"

# 5. a private fstab: -a mounts the _netdev sanfs lines (not noauto), a line by mount point
cat > "$T/fstab" <<EOF
# sanfs lines as an admin writes them
$ADDR:/ $T/c sanfs _netdev,devices=$LUNS,threshold=64k,log=$T/c.log 0 0
$ADDR:/ $T/d sanfs _netdev,noauto,devices=$LUNS,log=$T/d.log 0 0
EOF
mount --fstab "$T/fstab" -a -t sanfs -O _netdev
mounted "$T/c" || fail "mount -a did not mount c"
mounted "$T/d" && fail "mount -a mounted the noauto line"
mount --fstab "$T/fstab" "$T/d"
mounted "$T/d" || fail "mount by mount point did not mount d"
mount --fstab "$T/fstab" -a -t sanfs -O _netdev
[ "$(grep -c " $T/c " /proc/self/mountinfo)" = 1 ] || fail "mount -a mounted c twice"
echo "PID=$(pid_of "$T/c")"
echo "PID=$(pid_of "$T/d")"
dd if="$T/src" of="$T/c/big" bs=1M count=2 oflag=direct status=none
[ "$(bytes "$T/c" direct_write)" -ge 2097152 ] || fail "threshold=64k: 1 MiB writes not direct"
cmp "$T/a/f" "$T/d/f"
[ "$(cat "$T/d/rw")" = "yes
again
third" ] || fail "d does not see a's writes"

# 6. umount: each agent exits (the test checks their status)
for m in a b c d; do umount "$T/$m"; mounted "$T/$m" && fail "$m still mounted"; done

# 7. kill -9: the mount answers ENOTCONN, not a hang; umount and umount -l work
mount -t sanfs "$ADDR:/" "$T/k1" -o "devices=$LUNS,log=$T/k1.log"
mount -t sanfs "$ADDR:/" "$T/k2" -o "devices=$LUNS,log=$T/k2.log"
k1=$(pid_of "$T/k1"); k2=$(pid_of "$T/k2")
echo "KILLED=$k1"; echo "KILLED=$k2"
kill -9 "$k1" "$k2"
for k in k1 k2; do
  for _ in $(seq 100); do
    out=$(timeout 10 stat "$T/$k/f" 2>&1) && fail "stat on a dead mount worked"
    echo "$out" | grep -q "Transport endpoint is not connected" && break
    sleep 0.1
  done
  echo "$out" | grep -q "Transport endpoint is not connected" || fail "$k: $out"
done
timeout 10 umount "$T/k1"
timeout 10 umount -l "$T/k2"
mounted "$T/k1" && fail "k1 still mounted"
mounted "$T/k2" && fail "k2 still mounted"
echo DONE
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mount_t_sanfs_fstab_remount_umount_and_a_killed_agent() {
    if !can_mount() {
        return;
    }
    if (!sanfs_testcluster::has_tool("unshare")
        || !std::fs::read_to_string("/proc/filesystems").is_ok_and(|f| f.contains("overlay")))
        && sanfs_testcluster::skip(
            "mount_t_sanfs_fstab_remount_umount_and_a_killed_agent",
            "needs unshare(1) and overlayfs for a private /sbin/mount.sanfs",
        )
    {
        return;
    }
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) only changes who reaps orphaned descendants.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let srv = cluster::start(10_000).await;
    let dir = tempfile::tempdir().unwrap();
    let luns: Vec<String> = srv.luns.iter().map(|p| p.display().to_string()).collect();
    let t = dir.path().to_path_buf();
    let addr = srv.addr.to_string();
    let out = tokio::task::spawn_blocking(move || {
        run_timeout(
            Command::new("unshare")
                .args(["-m", "--propagation", "private", "bash", "-c", SCENARIO])
                .env("T", &t)
                .env("AGENT", env!("CARGO_BIN_EXE_sanfs-agent"))
                .env("ADDR", addr)
                .env("LUNS", luns.join(":"))
                .env("SANFS_RUN_DIR", t.join("run"))
                .env("RUST_LOG", "info"),
            240,
        )
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let pids = |tag: &str| -> Vec<i32> {
        stdout
            .lines()
            .filter_map(|l| l.strip_prefix(tag))
            .map(|p| p.parse().unwrap())
            .collect()
    };
    let (clean, killed) = (pids("PID="), pids("KILLED="));
    // Reap every agent the scenario started, also when it failed half-way.
    let statuses: Vec<(i32, Option<i32>)> = clean
        .iter()
        .chain(&killed)
        .map(|&p| (p, reap(p, 20)))
        .collect();
    assert!(
        out.status.success() && stdout.contains("DONE"),
        "scenario failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert_eq!(clean.len(), 4, "{stdout}");
    assert_eq!(killed.len(), 2, "{stdout}");
    for (pid, st) in statuses {
        let st = st.unwrap_or_else(|| panic!("agent {pid} did not end"));
        if killed.contains(&pid) {
            assert!(
                libc::WIFSIGNALED(st) && libc::WTERMSIG(st) == libc::SIGKILL,
                "{pid}: {st:#x}"
            );
        } else {
            assert!(
                libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
                "agent {pid} after umount: wait status {st:#x}"
            );
        }
    }
    srv.stop().await;
}

/// `mount.sanfs` as mount(8) calls it, without root: `-f` (fake) checks and mounts nothing,
/// bad invocations and options are refused with status 1.
#[test]
fn mount_sanfs_helper_fake_and_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let helper = dir.path().join("mount.sanfs");
    symlink(env!("CARGO_BIN_EXE_sanfs-agent"), &helper).unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let run = |args: &[&str]| run_timeout(Command::new(&helper).args(args), 30);
    let m = mnt.to_str().unwrap();
    let out = run(&[
        "mds:7410:/x",
        m,
        "-f",
        "-v",
        "-n",
        "-o",
        "threshold=1M,_netdev",
    ]);
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("would mount mds:7410:/x at"), "{said}");
    assert!(said.contains("threshold=1M"), "{said}");
    assert!(!is_fuse_mount(&mnt));
    // Several servers, as an fstab line names them (an entry without a port takes the next's).
    let out = run(&["mds1,mds2:7410:/x", m, "-f", "-v", "-o", "_netdev"]);
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("would mount mds1,mds2:7410:/x at"), "{said}");
    for (args, msg) in [
        (
            vec!["mds:7410", m, "-o", "threshold=1.5Q"],
            "threshold=1.5Q",
        ),
        (vec!["mds:7410", m, "-o", "attr_ttl=soon"], "attr_ttl"),
        (
            vec!["mds:7410", m, "-o", "nosuchoption"],
            "unknown mount option",
        ),
        (vec!["mds", m], "not SERVER:PORT"),
        (vec!["mds1,,mds2:7410", m], "empty entry"),
        (vec!["mds1:7410,mds1:7410:/x", m], "names mds1:7410 twice"),
        (vec!["mds1:7410,mds2:port", m], "bad port"),
        (vec!["mds1:7410,unix:/run/s.sock", m], "single server"),
        (vec!["mds:7410"], "expected SPEC and DIR"),
        (vec!["mds:7410", m, "-t", "nfs"], "type sanfs"),
    ] {
        let out = run(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("mount.sanfs: ") && err.contains(msg),
            "{args:?}: {err}"
        );
    }
    // A mount point that is not there: the mount fails (32), with the reason.
    let out = run(&["mds:7410", "/nonexistent/sanfs-mnt"]);
    assert_eq!(out.status.code(), Some(32), "{out:?}");
}

fn is_fuse_mount(p: &Path) -> bool {
    sanfs_client_agent::control::fuse_mounts()
        .unwrap()
        .iter()
        .any(|m| m.mount_point == p)
}
