//! The `sanfs-mds` command line.

fn main() -> std::process::ExitCode {
    eprintln!("sanfs-mds: the metadata server is not built yet (see issue 3)");
    std::process::ExitCode::from(2)
}
