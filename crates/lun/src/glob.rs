//! Device globs: `*` and `?` in the last path component of a LUN path, expanded against the
//! directory (`/dev/disk/by-id/wwn-0x600a*`). The agent's `devices=` and the server's
//! `volume.devices` both name LUNs this way; which LUN a path is stays the label's word (the
//! import rule), never the order of the matches.

use std::path::{Path, PathBuf};

/// Whether `name` matches `pattern`, where `*` matches any run of characters and `?` one.
pub fn wildcard_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ni));
                pi += 1;
            }
            Some(&c) if c == '?' || c == n[ni] => {
                pi += 1;
                ni += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    pi = sp + 1;
                    ni = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// The paths the globs name, in glob order, each glob's matches sorted. Wildcards are honoured
/// in the last component only; a path without wildcards is returned if it exists.
pub fn expand_globs<P: AsRef<Path>>(globs: &[P]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for glob in globs {
        let path = glob.as_ref();
        let Some(last) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !last.contains(['*', '?']) {
            if path.exists() {
                out.push(path.to_path_buf());
            }
            continue;
        }
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
                    .is_some_and(|n| wildcard_match(last, n))
            })
            .map(|e| e.path())
            .collect();
        matches.sort();
        out.extend(matches);
    }
    out
}

/// Whether `path` has a wildcard (`*` or `?`) in its last component.
pub fn is_glob(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains(['*', '?']))
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
    }
}
