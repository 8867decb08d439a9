//! A sanfs test SAN on one machine.
//!
//! A real cluster is nodes on a LAN that all see the same LUNs. Here that is: files attached as
//! loop devices with direct I/O ([`Luns`]), a network namespace per node joined to the server's
//! namespace by veth pairs on a bridge ([`Network`], [`Netns`]), a blkio cgroup that caps each
//! LUN's bandwidth so that loop devices behave like independent disks ([`Throttle`]), and guards
//! that kill and reap exactly the processes a test started ([`ChildGuard`]), and an etcd
//! cluster of 1 or 3 members for the metadata server's high availability ([`EtcdCluster`]).
//!
//! Everything is a RAII guard: what a test made is removed by its exact name when the guard is
//! dropped, also when the test fails. Nothing here knows sanfs' agent; tests and the bench start
//! it themselves (as processes with [`Netns::command`], or in-process on a thread with
//! [`Netns::run_thread`]). With the `mds` feature, `mds` makes the file system the way an
//! operator does (format the LUNs, create the metadata store) and serves it in-process: the one
//! place the server's, the agent's and the bench's tests set one up.
//!
//! Without root there are no loop devices, namespaces or cgroups: [`Luns`] are plain files, and
//! [`Network`] puts every node on the host's loopback, so the same test runs everywhere. A test
//! that cannot run at all without root (or a device or a program) asks [`skip_unless`] (or
//! [`skip_unless_root`], [`skip`]): it is skipped with a line saying why, or fails under
//! `SANFS_REQUIRE_ROOT=1`, which CI sets, so that a test that did not run never passes there.

mod child;
mod etcd;
mod gate;
mod luns;
#[cfg(feature = "mds")]
pub mod mds;
mod netns;
mod throttle;

pub use child::ChildGuard;
pub use etcd::EtcdCluster;
pub use gate::{
    Need, REQUIRE_ENV, has_tool, is_root, required, skip, skip_unless, skip_unless_root,
};
pub use luns::{LunKind, Luns};
pub use netns::{Netns, Network};
pub use throttle::Throttle;

use std::sync::atomic::{AtomicU32, Ordering};

/// A name no other guard of this machine uses: `sanfs-TAG-PID-N`. Tags are cut to keep the
/// name short (interface and cgroup names have limits).
pub(crate) fn unique_name(tag: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tag: String = tag
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(12)
        .collect();
    format!("sanfs-{tag}-{}-{n}", std::process::id())
}

/// Runs a command to completion; an error carries its stderr.
pub(crate) fn run(cmd: &mut std::process::Command) -> anyhow::Result<String> {
    let out = cmd
        .output()
        .map_err(|e| anyhow::anyhow!("run {cmd:?}: {e}"))?;
    if !out.status.success() {
        anyhow::bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
