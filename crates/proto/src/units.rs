//! Sizes and durations as people write them, read one way on every surface: `mds.toml`, the
//! server's and the bench's command lines, mount options, the CSI driver's flags and
//! StorageClass parameters.
//!
//! **Sizes** are binary: `K`, `KB`, `KiB` (any case) all mean 1024, `M`/`MB`/`MiB` 1024^2, and
//! so on up to `E`; a plain number is bytes; a fraction (`1.5G`) and a space before the unit
//! are accepted; the result must be a whole number of bytes (`1.5` is refused) that fits 64
//! bits. (Storage sizes
//! are binary in LVM, the kernel and Kubernetes' `Ki`/`Mi`; decimal "KB" meaning 1000 would
//! make "64KB" a stripe unit that is not a multiple of any block.)
//!
//! **Durations**: a unit is required except for a plain number, which is seconds: `30`, `1s`,
//! `250ms`, `2m`, `1h`, `1h 30m`, `1.5s` is not (write `1500ms`).

use std::time::Duration;

/// A size in bytes (see the module doc).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("an empty size (e.g. 65536, 64KiB, 1G)".to_owned());
    }
    let config = parse_size::Config::new().with_binary();
    let bytes = config
        .parse_size(t)
        .map_err(|e| format!("size {text:?}: {e} (e.g. 65536, 64KiB, 1G)"))?;
    // A fraction must come out a whole number of bytes (`1.5K`, not `1.5` or `0.3K`): the
    // parser would round it.
    let number_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(number_end);
    if number.contains('.') {
        let unit_bytes = config
            .parse_size(format!("1{unit}"))
            .map_err(|e| format!("size {text:?}: {e}"))?;
        let exact = number
            .parse::<f64>()
            .map_err(|e| format!("size {text:?}: {e}"))?
            * unit_bytes as f64;
        if exact.fract() != 0.0 {
            return Err(format!("size {text:?} is not a whole number of bytes"));
        }
    }
    Ok(bytes)
}

/// A duration (see the module doc).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t
            .parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|e| format!("duration {text:?}: {e}"));
    }
    humantime::parse_duration(t)
        .map_err(|e| format!("duration {text:?}: {e} (e.g. 30s, 250ms, 2m, 1h)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_binary_whatever_the_spelling() {
        for (text, bytes) in [
            ("0", 0),
            ("4096", 4096),
            ("64k", 64 << 10),
            ("64K", 64 << 10),
            ("64KB", 64 << 10),
            ("64kB", 64 << 10),
            ("64KiB", 64 << 10),
            (" 64 KiB ", 64 << 10),
            ("1M", 1 << 20),
            ("1MiB", 1 << 20),
            ("1.5G", 3 << 29),
            ("10Gi", 10 << 30),
            ("2T", 2 << 40),
            ("1TiB", 1 << 40),
            ("1P", 1 << 50),
            ("512B", 512),
            ("0.5K", 512),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
    }

    #[test]
    fn bad_sizes_are_refused_with_the_text() {
        for bad in [
            "",
            "  ",
            "K",
            "1Q",
            "-1",
            "1.5",
            "0.3K",
            "64 KiBs",
            "99999999999T",
            "1e30",
        ] {
            let e = parse_size(bad).expect_err(bad);
            assert!(e.contains("size") || e.contains("empty"), "{bad}: {e}");
        }
    }

    #[test]
    fn durations_need_a_unit_except_plain_seconds() {
        for (text, d) in [
            ("0", Duration::ZERO),
            ("30", Duration::from_secs(30)),
            ("1s", Duration::from_secs(1)),
            ("250ms", Duration::from_millis(250)),
            ("2m", Duration::from_secs(120)),
            ("1h", Duration::from_secs(3600)),
            ("1h 30m", Duration::from_secs(5400)),
        ] {
            assert_eq!(parse_duration(text), Ok(d), "{text}");
        }
        for bad in ["", "s", "1x", "-1s", "soon"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }
}
