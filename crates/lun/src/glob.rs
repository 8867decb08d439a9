//! Device globs: shell wildcards (`*`, `?` and `[...]` classes) in the last path component of
//! a LUN path, expanded against the directory (`/dev/disk/by-id/wwn-0x600a*`). The agent's
//! `devices=` and the server's `volume.devices` both name LUNs this way; which LUN a path is
//! stays the label's word (the import rule), never the order of the matches.
//!
//! The component is matched by the `glob` crate's [`Pattern`]: `*` any run of characters
//! (a leading `.` too), `?` one, `[abc]`/`[a-z]`/`[!a-z]` one of (or none of) a set, `[*]` a
//! literal `*`. The directory part is a plain path, never expanded. A last component that is
//! not a valid pattern (an unclosed `[`) is a plain path.

use std::path::{Path, PathBuf};

use glob::{MatchOptions, Pattern};

/// How a component is matched: case-sensitive, a leading `.` matched by wildcards like any
/// other character (there is no separator in one component).
const MATCH: MatchOptions = MatchOptions {
    case_sensitive: true,
    require_literal_separator: false,
    require_literal_leading_dot: false,
};

/// The pattern of a component, if it has wildcards and is a valid pattern.
fn pattern(component: &str) -> Option<Pattern> {
    if !component.contains(['*', '?', '[']) {
        return None;
    }
    Pattern::new(component).ok()
}

/// Whether `name` matches `pattern` (see the module doc); an invalid pattern matches only
/// itself.
pub fn wildcard_match(pattern: &str, name: &str) -> bool {
    match Pattern::new(pattern) {
        Ok(p) => p.matches_with(name, MATCH),
        Err(_) => pattern == name,
    }
}

/// The paths the globs name, in glob order, each glob's matches sorted. Wildcards are honoured
/// in the last component only; a path without wildcards is returned if it exists.
pub fn expand_globs<P: AsRef<Path>>(globs: &[P]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for glob in globs {
        let path = glob.as_ref();
        let Some(last) = path.file_name() else {
            continue;
        };
        let Some(pattern) = last.to_str().and_then(pattern) else {
            if path.exists() {
                out.push(path.to_path_buf());
            }
            continue;
        };
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
        let dir = dir.unwrap_or(Path::new("."));
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut matches: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| pattern.matches_with(n, MATCH))
            })
            .map(|e| e.path())
            .collect();
        matches.sort();
        out.extend(matches);
    }
    out
}

/// Whether `path` has a wildcard (`*`, `?` or a `[...]` class) in its last component.
pub fn is_glob(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .and_then(pattern)
        .is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_like_a_shell() {
        for (p, n, want) in [
            ("*", "", true),
            ("*", "sda", true),
            ("sd*", "sda1", true),
            ("sd*", "vda", false),
            ("nvme*n*", "nvme0n1", true),
            ("nvme*n*", "nvme0", false),
            ("loop?", "loop7", true),
            ("loop?", "loop17", false),
            ("a*b*c", "aXXbYYc", true),
            ("a*b*c", "aXXbYY", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
            (".*", ".hidden", true),
            ("*", ".hidden", true),
            ("loop[0-3]", "loop2", true),
            ("loop[0-3]", "loop7", false),
            ("loop[!0-3]", "loop7", true),
            ("sd[ab]", "sdb", true),
            ("wwn[*]", "wwn*", true),
            ("wwn[*]", "wwnX", false),
            ("Sd*", "sda", false),
            ("lun[", "lun[", true),
            ("lun[", "lunX", false),
        ] {
            assert_eq!(wildcard_match(p, n), want, "{p} vs {n}");
        }
    }

    #[test]
    fn globs_expand_in_the_last_component_and_plain_paths_pass_through() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["lun1", "lun0", "other"] {
            std::fs::write(dir.path().join(n), b"x").unwrap();
        }
        let d = dir.path().display();
        let got = expand_globs(&[
            format!("{d}/lun*"),
            format!("{d}/other"),
            format!("{d}/absent"),
            format!("{d}/nomatch*"),
        ]);
        let names: Vec<_> = got
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
            .collect();
        assert_eq!(names, ["lun0", "lun1", "other"]);
    }

    #[test]
    fn only_the_last_component_is_a_glob() {
        assert!(is_glob(Path::new("/dev/disk/by-id/wwn-0x600a*")));
        assert!(is_glob(Path::new("/dev/loop?")));
        assert!(!is_glob(Path::new("/dev/loop0")));
        assert!(!is_glob(Path::new("/dev/*/loop0")));
        assert!(is_glob(Path::new("/dev/loop[0-3]")));
        assert!(
            !is_glob(Path::new("/dev/lun[")),
            "not a valid pattern: a plain path"
        );
    }

    #[test]
    fn classes_expand_and_the_directory_is_not_a_pattern() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("by-id [h18]*");
        std::fs::create_dir(&sub).unwrap();
        for n in ["lun0", "lun1", "lun2", "lun[", ".lun9"] {
            std::fs::write(sub.join(n), b"x").unwrap();
        }
        let d = sub.display();
        let names = |globs: &[String]| -> Vec<String> {
            expand_globs(globs)
                .iter()
                .map(|p| {
                    assert_eq!(p.parent(), Some(sub.as_path()));
                    p.file_name().unwrap().to_str().unwrap().to_owned()
                })
                .collect()
        };
        assert_eq!(
            names(&[format!("{d}/lun[!1]"), format!("{d}/lun[")]),
            ["lun0", "lun2", "lun[", "lun["]
        );
        assert_eq!(names(&[format!("{d}/*9")]), [".lun9"]);
        let other = dir.path().join("by-id [h18]x");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("lun0"), b"x").unwrap();
        assert_eq!(names(&[format!("{d}/lun0")]), ["lun0"]);
    }
}
