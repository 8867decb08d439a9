//! Compiles `proto/sanfs/v1/sanfs.proto` into Rust with protox (a pure-Rust protobuf compiler,
//! so no `protoc` is needed anywhere) feeding tonic-prost-build. Also writes the encoded
//! `FileDescriptorSet`, which the crate exports for gRPC reflection and for the fuzz test.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = PathBuf::from("proto");
    let proto_file = proto_dir.join("sanfs/v1/sanfs.proto");
    println!("cargo:rerun-if-changed={}", proto_file.display());

    let mut compiler = protox::Compiler::new([&proto_dir])?;
    compiler
        .include_source_info(true)
        .include_imports(true)
        .open_file(&proto_file)?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("sanfs_v1_descriptor.bin"),
        compiler.encode_file_descriptor_set(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
