//! The `sanfs-bench` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sanfs_bench::metadata::{MetadataParams, run};

#[derive(Debug, Parser)]
#[command(
    name = "sanfs-bench",
    version,
    about = "sanfs benchmarks: the paper's experiments on your hardware"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Metadata operations per second through gRPC, and operations per durable commit.
    Metadata {
        /// Concurrent callers.
        #[arg(long, default_value_t = 16)]
        callers: usize,
        /// Files per caller.
        #[arg(long, default_value_t = 500)]
        files: usize,
        /// Directory for the metadata store file (default: a temporary directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Also write the result as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sanfs-bench: start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Metadata {
                callers,
                files,
                dir,
                json,
            } => {
                let report = run(&MetadataParams {
                    callers,
                    files,
                    dir,
                })
                .await?;
                println!("{report}");
                if let Some(path) = json {
                    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;
                }
                anyhow::Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sanfs-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
