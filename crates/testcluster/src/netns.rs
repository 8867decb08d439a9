//! Network namespaces as cluster nodes.
//!
//! A [`Netns`] holds one node's network: its own loopback and interfaces. Programs run in it
//! with `nsenter --net=...`, which enters the network namespace only: the mount namespace stays
//! the host's, so a FUSE mount made by an agent in a node's namespace is visible to the test.
//! (`ip netns exec` would also unshare the mount namespace and hide it.)

use std::ffi::OsStr;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rustix::thread::{LinkNameSpaceType, move_into_link_name_space};

use crate::{is_root, run, unique_name};

/// One network namespace, deleted (by its exact name) on drop; or the host's own network.
#[derive(Debug)]
pub struct Netns {
    name: Option<String>,
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    run(Command::new("ip").args(args)).map(drop)
}

impl Netns {
    /// Creates a namespace named `sanfs-TAG-PID-N` with its loopback up.
    pub fn create(tag: &str) -> anyhow::Result<Netns> {
        let name = unique_name(tag);
        ip(&["netns", "add", &name])?;
        let ns = Netns { name: Some(name) };
        ip(&["-n", ns.id(), "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The host's network (what a node is when there is no root to make namespaces).
    pub fn host() -> Netns {
        Netns { name: None }
    }

    /// The namespace's name; `None` for the host.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn id(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }

    /// The file that names the namespace (`/run/netns/NAME`).
    pub fn path(&self) -> Option<PathBuf> {
        self.name
            .as_ref()
            .map(|n| PathBuf::from("/run/netns").join(n))
    }

    /// A command that runs `program` inside this namespace (network only; see the module doc).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        match self.path() {
            None => Command::new(program),
            Some(path) => {
                let mut cmd = Command::new("nsenter");
                let mut net = std::ffi::OsString::from("--net=");
                net.push(path);
                cmd.arg(net).arg("--").arg(program);
                cmd
            }
        }
    }

    /// Runs `f` on a new thread whose sockets live in this namespace (for instance an
    /// in-process server on a current-thread tokio runtime). Only that thread moves.
    pub fn run_thread<T, F>(
        &self,
        name: &str,
        f: F,
    ) -> anyhow::Result<JoinHandle<anyhow::Result<T>>>
    where
        T: Send + 'static,
        F: FnOnce() -> anyhow::Result<T> + Send + 'static,
    {
        let path = self.path();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                if let Some(path) = path {
                    let ns = std::fs::File::open(&path)
                        .with_context(|| format!("open {}", path.display()))?;
                    move_into_link_name_space(
                        std::os::fd::AsFd::as_fd(&ns),
                        Some(LinkNameSpaceType::Network),
                    )
                    .with_context(|| format!("setns {}", path.display()))?;
                }
                f()
            })
            .context("spawn thread")
    }

    /// Waits until something accepts TCP connections at `addr` as seen from this namespace.
    pub fn wait_for_tcp(&self, addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
        let probe = self.run_thread("tcp-probe", move || {
            let deadline = Instant::now() + timeout;
            loop {
                match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                    Ok(_) => return Ok(()),
                    Err(e) if Instant::now() >= deadline => {
                        bail!("nothing accepts at {addr} after {timeout:?}: {e}")
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        })?;
        probe
            .join()
            .map_err(|_| anyhow::anyhow!("tcp probe panicked"))?
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Some(name) = &self.name
            && let Err(e) = ip(&["netns", "del", name])
        {
            eprintln!("testcluster: could not delete netns {name}: {e}");
        }
    }
}

/// The cluster's LAN: a server namespace with a bridge (10.77.0.1/24) and N node namespaces,
/// each joined to the bridge by a veth pair (node i is 10.77.0.(i+2)). The addresses exist only
/// inside these namespaces. Without root every node is the host, on 127.0.0.1.
#[derive(Debug)]
pub struct Network {
    // Dropped first: a node's veth goes with its namespace.
    nodes: Vec<Netns>,
    server: Netns,
}

const SUBNET: [u8; 3] = [10, 77, 0];
const MAX_NODES: usize = 200;

impl Network {
    /// Network namespaces when root (and `ip` works), the host's loopback otherwise.
    pub fn create(nodes: usize) -> anyhow::Result<Network> {
        if is_root() {
            Self::isolated(nodes)
        } else {
            Ok(Self::loopback(nodes))
        }
    }

    /// Every node on the host's loopback.
    pub fn loopback(nodes: usize) -> Network {
        Network {
            nodes: (0..nodes).map(|_| Netns::host()).collect(),
            server: Netns::host(),
        }
    }

    /// A namespace per node and one for the server; needs root.
    pub fn isolated(nodes: usize) -> anyhow::Result<Network> {
        if nodes > MAX_NODES {
            bail!("at most {MAX_NODES} nodes");
        }
        let mut net = Network {
            nodes: Vec::with_capacity(nodes),
            server: Netns::create("srv")?,
        };
        let srv = net.server.id().to_owned();
        let server_cidr = format!("{}/24", net.server_ip());
        ip(&["-n", &srv, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &srv, "addr", "add", &server_cidr, "dev", "br0"])?;
        ip(&["-n", &srv, "link", "set", "br0", "up"])?;
        for i in 0..nodes {
            let node = Netns::create(&format!("n{i}"))?;
            let node_name = node.id().to_owned();
            net.nodes.push(node);
            let port = format!("vn{i}");
            let node_cidr = format!("{}/24", net.node_ip(i));
            ip(&[
                "-n", &srv, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &node_name,
            ])?;
            ip(&["-n", &srv, "link", "set", &port, "master", "br0", "up"])?;
            ip(&["-n", &node_name, "addr", "add", &node_cidr, "dev", "eth0"])?;
            ip(&["-n", &node_name, "link", "set", "eth0", "up"])?;
        }
        Ok(net)
    }

    /// Whether nodes are namespaces of their own (false: all on the host's loopback).
    pub fn is_isolated(&self) -> bool {
        self.server.name.is_some()
    }

    pub fn server(&self) -> &Netns {
        &self.server
    }

    /// Node `i`'s namespace. Panics if there is no such node (a test's own mistake).
    pub fn node(&self, i: usize) -> &Netns {
        &self.nodes[i]
    }

    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// The server's address on the LAN.
    pub fn server_ip(&self) -> IpAddr {
        if self.is_isolated() {
            IpAddr::V4(Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], 1))
        } else {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        }
    }

    /// Node `i`'s address on the LAN.
    pub fn node_ip(&self, i: usize) -> IpAddr {
        if self.is_isolated() {
            // i < MAX_NODES, so this fits a u8 above the server's .1.
            IpAddr::V4(Ipv4Addr::new(
                SUBNET[0],
                SUBNET[1],
                SUBNET[2],
                (i + 2) as u8,
            ))
        } else {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        }
    }
}
