//! The crossover: the I/O size from which the direct path beats the proxied path on this
//! machine, for reads and for writes, and what to set `server.direct_threshold` to.
//!
//! Taken from figure 6's `direct` and `proxied` rows (the same files, the same run): the
//! crossover of an op is the smallest measured size at which, and at every larger size, direct
//! is faster.

use crate::fig6::Fig6;
use crate::io::Op;
use crate::util::size_label;

/// The crossover of one op.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Crossover {
    pub op: Op,
    /// None: direct never wins throughout (or there was nothing to compare).
    pub size: Option<u64>,
    /// direct MB/s over proxied MB/s, by size.
    pub speedup: Vec<(u64, f64)>,
}

/// The crossovers and the advice.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Threshold {
    pub crossovers: Vec<Crossover>,
    /// The threshold to configure (the larger crossover), if both ops have one.
    pub recommended: Option<u64>,
    /// The default threshold the server ships with.
    pub default: u64,
}

pub fn from_fig6(fig: &Fig6) -> Threshold {
    let mut t = Threshold {
        default: 64 * 1024,
        ..Threshold::default()
    };
    for op in [Op::Read, Op::Write] {
        let mut speedup = Vec::new();
        for &size in &fig.sizes {
            if let (Some(d), Some(p)) = (fig.get("direct", op, size), fig.get("proxied", op, size))
            {
                speedup.push((size, d.mb_s / p.mb_s.max(1e-9)));
            }
        }
        // The smallest size from which direct wins at every measured size.
        let mut size = None;
        for &(s, r) in speedup.iter().rev() {
            if r > 1.0 {
                size = Some(s);
            } else {
                break;
            }
        }
        t.crossovers.push(Crossover { op, size, speedup });
    }
    let sizes: Vec<Option<u64>> = t.crossovers.iter().map(|c| c.size).collect();
    if !sizes.is_empty() && sizes.iter().all(Option::is_some) {
        t.recommended = sizes.into_iter().flatten().max();
    }
    t
}

impl std::fmt::Display for Threshold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Crossover: direct path vs proxied path (MB/s direct / MB/s proxied)"
        )?;
        for c in &self.crossovers {
            let cells: Vec<String> = c
                .speedup
                .iter()
                .map(|(s, r)| format!("{} {:.2}x", size_label(*s), r))
                .collect();
            writeln!(f, "{:<6} {}", c.op.name(), cells.join("  "))?;
            match c.size {
                Some(s) => writeln!(f, "{:<6} direct is faster from {} on", "", size_label(s))?,
                None => writeln!(f, "{:<6} direct never wins at every larger size", "")?,
            }
        }
        match self.recommended {
            Some(r) if r == self.default => writeln!(
                f,
                "advice: the default direct_threshold ({}) fits this machine; keep it",
                size_label(self.default)
            ),
            Some(r) => writeln!(
                f,
                "advice: set server.direct_threshold = \"{}\" in mds.toml (default {}): below it \
                 the proxied path is faster here",
                size_label(r),
                size_label(self.default)
            ),
            None => writeln!(
                f,
                "advice: no single crossover measured; keep the default ({})",
                size_label(self.default)
            ),
        }
    }
}
