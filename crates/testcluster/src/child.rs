//! A child process that a test started and that must not outlive it.

use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::Context;
use rustix::process::{Pid, Signal, kill_process};

/// A child killed (SIGKILL, by its own pid) and reaped on drop unless it already exited.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    status: Option<ExitStatus>,
}

impl ChildGuard {
    /// Starts `cmd`.
    pub fn spawn(cmd: &mut Command) -> anyhow::Result<ChildGuard> {
        let child = cmd.spawn().with_context(|| format!("start {cmd:?}"))?;
        Ok(ChildGuard {
            child,
            status: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The child, e.g. to take its stdout.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Its exit status if it has exited (reaping it).
    pub fn try_wait(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait().context("wait for child")?;
        }
        Ok(self.status)
    }

    /// Waits at most `timeout` for it to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> anyhow::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` to it (nothing if it already exited and was reaped).
    pub fn signal(&mut self, signal: Signal) -> anyhow::Result<()> {
        if self.try_wait()?.is_some() {
            return Ok(());
        }
        let pid = Pid::from_raw(self.pid() as i32).context("child pid")?;
        kill_process(pid, signal).with_context(|| format!("signal {signal:?} to {pid:?}"))
    }

    /// SIGKILL, then reap: what `kill -9` does to a node's agent.
    pub fn kill9(&mut self) -> anyhow::Result<ExitStatus> {
        self.signal(Signal::KILL)?;
        let status = self.child.wait().context("reap child")?;
        self.status = Some(status);
        Ok(status)
    }

    /// SIGTERM, `grace` to exit, then SIGKILL.
    pub fn terminate(&mut self, grace: Duration) -> anyhow::Result<ExitStatus> {
        self.signal(Signal::TERM)?;
        match self.wait_timeout(grace)? {
            Some(s) => Ok(s),
            None => self.kill9(),
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.status.is_none() && !matches!(self.child.try_wait(), Ok(Some(_))) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
