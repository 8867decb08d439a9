//! `sanfs-bench`: the paper's experiments (issue 7) and the criterion benchmarks of the pure core.
