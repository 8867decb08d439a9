//! The `sanfs-mds` command line: `format`, `serve`, `fsck`, `volume inspect`.

fn main() -> std::process::ExitCode {
    eprintln!("sanfs-mds: being built (issue 3)");
    std::process::ExitCode::from(2)
}
