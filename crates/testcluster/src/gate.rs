//! The one gate for tests that need root or something of the machine (loop devices, /dev/fuse,
//! a program such as lvm2's): they run where they can, and elsewhere either say that they were
//! skipped and pass, or, under `SANFS_REQUIRE_ROOT=1` (set by `scripts/test-all`, and so by
//! CI), fail with the reason. A skipped test in CI is a test that did not run: it must not pass.

use std::path::Path;

/// The environment variable under which a test that cannot run fails instead of skipping.
pub const REQUIRE_ENV: &str = "SANFS_REQUIRE_ROOT";

/// What a test needs besides root.
#[derive(Debug, Clone, Copy)]
pub enum Need<'a> {
    /// /dev/fuse (FUSE mounts; the agent mounts without fusermount).
    Fuse,
    /// /dev/loop-control and losetup(8) (loop-device LUNs).
    LoopDevices,
    /// A program on `PATH` or in the sbin directories (a non-login root shell may lack them).
    Tool(&'a str),
}

impl Need<'_> {
    /// Why it is missing here; `None` when it is there.
    fn missing(&self) -> Option<String> {
        match *self {
            Need::Fuse => (!Path::new("/dev/fuse").exists()).then(|| "/dev/fuse".to_owned()),
            Need::LoopDevices => {
                if !Path::new("/dev/loop-control").exists() {
                    Some("/dev/loop-control".to_owned())
                } else if !has_tool("losetup") {
                    Some("losetup (util-linux)".to_owned())
                } else {
                    None
                }
            }
            Need::Tool(name) => (!has_tool(name)).then(|| name.to_owned()),
        }
    }
}

/// Whether this process runs as root (loop devices, namespaces, cgroups and FUSE need it).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Whether every gated test must run here (`SANFS_REQUIRE_ROOT=1`).
pub fn required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// Whether `name` is a program on `PATH` or in /usr/sbin, /sbin.
pub fn has_tool(name: &str) -> bool {
    find_tool(name).is_some()
}

/// Where [`has_tool`] finds `name`: the program to run (a non-login root shell's `PATH` may
/// lack the sbin directories).
pub(crate) fn find_tool(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(Into::into))
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Returns true (after saying so) when `test` must be skipped because this process is not root;
/// fails the test instead under `SANFS_REQUIRE_ROOT=1`.
pub fn skip_unless_root(test: &str) -> bool {
    skip_unless(test, &[])
}

/// Returns true (after saying so) when `test` must be skipped because this process is not root
/// or one of `needs` is missing; fails the test instead under `SANFS_REQUIRE_ROOT=1`.
pub fn skip_unless(test: &str, needs: &[Need<'_>]) -> bool {
    let mut missing: Vec<String> = Vec::new();
    if !is_root() {
        missing.push("root".to_owned());
    }
    missing.extend(needs.iter().filter_map(Need::missing));
    if missing.is_empty() {
        return false;
    }
    skip(test, &format!("needs {}", missing.join(", ")))
}

/// Skips `test` for a reason its own check found (`why`, e.g. "needs mkfs.xfs"): says so and
/// returns true, or fails the test under `SANFS_REQUIRE_ROOT=1`.
pub fn skip(test: &str, why: &str) -> bool {
    let line = skip_line(test, why, required());
    if required() {
        panic!("{line}");
    }
    eprintln!("{line}");
    true
}

/// What [`skip`] prints (or panics with, when `required`).
fn skip_line(test: &str, why: &str, required: bool) -> String {
    if required {
        format!(
            "{test} cannot run here ({why}), and {REQUIRE_ENV}=1 says every root-only test must \
             run: install what it needs or run it as root"
        )
    } else {
        format!("skipped: {test} ({why}; {REQUIRE_ENV}=1 makes this a failure)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tool_is_missing_and_a_present_one_is_not() {
        assert!(Need::Tool("sanfs-no-such-program-xyz").missing().is_some());
        // sh is on every machine these tests run on.
        assert!(Need::Tool("sh").missing().is_none());
        assert!(!has_tool("sanfs-no-such-program-xyz"));
    }

    #[test]
    fn the_skip_line_names_the_test_the_reason_and_the_variable() {
        let skipped = skip_line("the x test", "needs root", false);
        assert!(
            skipped.starts_with("skipped: the x test (needs root"),
            "{skipped}"
        );
        assert!(skipped.contains(REQUIRE_ENV), "{skipped}");
        let failed = skip_line("the x test", "needs /dev/fuse", true);
        assert!(
            failed.contains("the x test cannot run here (needs /dev/fuse)"),
            "{failed}"
        );
        assert!(failed.contains("SANFS_REQUIRE_ROOT=1"), "{failed}");
    }
}
