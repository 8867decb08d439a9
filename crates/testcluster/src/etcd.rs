//! An etcd cluster for tests of the metadata server's high availability: 1 or 3 members of
//! the system's `etcd` (Debian's `etcd-server`) on 127.0.0.1, each a [`ChildGuard`].
//!
//! Ports are chosen by binding port 0 and releasing it; members are named after the cluster
//! (`sanfs-etcd-PID-N-mI`), keep their data in `dir/mI` and log to `dir/mI.log`. A member
//! stopped with [`EtcdCluster::stop_member`] (SIGKILL) and started again with
//! [`EtcdCluster::start_member`] reuses its data directory and ports: it rejoins. Dropping the
//! cluster kills exactly its members. Tests that need etcd ask the gate first
//! (`skip_unless(test, &[Need::Tool("etcd")])`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::gate::find_tool;
use crate::{ChildGuard, unique_name};

/// How long a member may take to answer `/health` (3 members elect a leader first).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// One member: where it listens and keeps its data, and its process while it runs.
#[derive(Debug)]
struct Member {
    name: String,
    data_dir: PathBuf,
    log: PathBuf,
    client: SocketAddr,
    peer: SocketAddr,
    child: Option<ChildGuard>,
}

/// See the module doc.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Member>,
    initial_cluster: String,
    token: String,
}

/// `n` distinct free ports on 127.0.0.1 (all held until all are chosen, then released).
fn free_addrs(n: usize) -> anyhow::Result<Vec<SocketAddr>> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").context("bind a free port"))
        .collect::<anyhow::Result<_>>()?;
    held.iter()
        .map(|l| l.local_addr().context("the bound port"))
        .collect()
}

impl EtcdCluster {
    /// Starts `members` (1 or 3) members with their data under `dir` (created if need be),
    /// and waits (bounded)
    /// until each answers `/health`.
    pub fn start(dir: &Path, members: usize) -> anyhow::Result<EtcdCluster> {
        if !(members == 1 || members == 3) {
            bail!("an etcd test cluster has 1 or 3 members, not {members}");
        }
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let token = unique_name("etcd");
        let addrs = free_addrs(2 * members)?;
        let members: Vec<Member> = (0..members)
            .map(|i| {
                let name = format!("{token}-m{i}");
                Member {
                    data_dir: dir.join(format!("m{i}")),
                    log: dir.join(format!("m{i}.log")),
                    client: addrs[2 * i],
                    peer: addrs[2 * i + 1],
                    name,
                    child: None,
                }
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            members,
            initial_cluster,
            token,
        };
        for i in 0..cluster.members.len() {
            cluster.spawn(i)?;
        }
        for i in 0..cluster.members.len() {
            cluster.wait_healthy(i, START_TIMEOUT)?;
        }
        Ok(cluster)
    }

    /// The client URLs of all members (`http://127.0.0.1:PORT`), stopped ones included.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://{}", m.client))
            .collect()
    }

    /// How many members the cluster has.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether it has no member (never: `start` makes 1 or 3).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Kills member `i` (SIGKILL) and reaps it: its data directory stays.
    pub fn stop_member(&mut self, i: usize) -> anyhow::Result<()> {
        let m = self.member(i)?;
        if let Some(mut child) = m.child.take() {
            child.kill9()?;
        }
        Ok(())
    }

    /// Starts member `i` again on its data directory and ports, and waits (bounded) until its
    /// client port accepts connections. It answers `/health` once it has a quorum again
    /// ([`EtcdCluster::wait_healthy`]).
    pub fn start_member(&mut self, i: usize) -> anyhow::Result<()> {
        if self.member(i)?.child.is_some() {
            bail!("etcd member {i} is running");
        }
        self.spawn(i)?;
        let deadline = Instant::now() + START_TIMEOUT;
        let addr = self.members[i].client;
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            self.check_running(i)?;
            if Instant::now() >= deadline {
                bail!("etcd member {i} does not listen on {addr} after {START_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Waits at most `timeout` until member `i` answers `/health` with `"health":"true"`
    /// (it is up and its cluster has a leader).
    pub fn wait_healthy(&mut self, i: usize, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let addr = self.member(i)?.client;
        loop {
            self.check_running(i)?;
            match health(addr) {
                Ok(true) => return Ok(()),
                Ok(false) | Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Ok(false) => bail!("etcd member {i} ({addr}) is not healthy after {timeout:?}"),
                Err(e) => {
                    return Err(e.context(format!(
                        "etcd member {i} ({addr}) does not answer /health after {timeout:?}"
                    )));
                }
            }
        }
    }

    /// The log of member `i` (its stdout and stderr).
    pub fn log(&self, i: usize) -> String {
        self.members
            .get(i)
            .and_then(|m| std::fs::read_to_string(&m.log).ok())
            .unwrap_or_default()
    }

    fn member(&mut self, i: usize) -> anyhow::Result<&mut Member> {
        let n = self.members.len();
        self.members
            .get_mut(i)
            .with_context(|| format!("no etcd member {i} (the cluster has {n})"))
    }

    /// Fails with the end of its log if member `i` has exited (or is not started).
    fn check_running(&mut self, i: usize) -> anyhow::Result<()> {
        let m = self.member(i)?;
        let Some(child) = m.child.as_mut() else {
            bail!("etcd member {i} is stopped");
        };
        if let Some(status) = child.try_wait()? {
            let log = std::fs::read_to_string(&m.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "etcd member {i} exited ({status}); the end of {}:\n{}",
                m.log.display(),
                tail.join("\n")
            );
        }
        Ok(())
    }

    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let (initial_cluster, token) = (self.initial_cluster.clone(), self.token.clone());
        let m = self.member(i)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .with_context(|| format!("open {}", m.log.display()))?;
        let err = log.try_clone().context("the etcd log")?;
        let client = format!("http://{}", m.client);
        let peer = format!("http://{}", m.peer);
        let program = find_tool("etcd").context("etcd is not installed (Debian: etcd-server)")?;
        let mut cmd = Command::new(program);
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial_cluster])
            .args(["--initial-cluster-token", &token])
            .args(["--initial-cluster-state", "new"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err);
        m.child = Some(ChildGuard::spawn(&mut cmd)?);
        Ok(())
    }
}

/// `GET /health` on a member's client port: whether it says `"health":"true"`.
fn health(addr: SocketAddr) -> anyhow::Result<bool> {
    let timeout = Duration::from_secs(2);
    let mut s = TcpStream::connect_timeout(&addr, timeout).context("connect")?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET /health HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).context("read the reply")?;
    Ok(reply.contains("\"health\":\"true\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_addrs_are_distinct_loopback_ports() {
        let addrs = free_addrs(6).unwrap();
        let mut ports: Vec<u16> = addrs.iter().map(|a| a.port()).collect();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 6);
        assert!(addrs.iter().all(|a| a.ip().is_loopback()));
    }

    #[test]
    fn only_one_or_three_members() {
        let dir = std::env::temp_dir();
        for n in [0, 2, 4] {
            let err = EtcdCluster::start(&dir, n).unwrap_err();
            assert!(format!("{err}").contains("1 or 3 members"), "{err}");
        }
    }
}
