//! Compiles `proto/sanfs/v1/sanfs.proto` and `proto/csi/v1/csi.proto` into Rust with protox (a
//! pure-Rust protobuf compiler, so no `protoc` is needed anywhere) feeding tonic-prost-build.
//! Also writes the encoded `FileDescriptorSet` of `sanfs.v1`, which the crate exports for gRPC
//! reflection and for the fuzz test. And the subset of etcd's v3 API that the server's leader
//! election uses (`proto/etcd/`, client side only).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = PathBuf::from("proto");
    let proto_file = proto_dir.join("sanfs/v1/sanfs.proto");
    let csi_file = proto_dir.join("csi/v1/csi.proto");
    println!("cargo:rerun-if-changed={}", proto_file.display());
    println!("cargo:rerun-if-changed={}", csi_file.display());

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

    // CSI v1: its own package and compiler run (it imports the well-known wrapper types,
    // which prost maps to `Option<bool>` / `Option<i64>`).
    let mut csi = protox::Compiler::new([&proto_dir])?;
    csi.include_imports(true).open_file(&csi_file)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .compile_fds(csi.file_descriptor_set())?;

    // etcd v3: the subset sanfs-mds uses for leader election (client side only).
    let etcd_files = [
        "etcd/mvccpb.proto",
        "etcd/etcdserverpb.proto",
        "etcd/v3electionpb.proto",
    ];
    for f in etcd_files {
        println!("cargo:rerun-if-changed={}", proto_dir.join(f).display());
    }
    let mut etcd = protox::Compiler::new([&proto_dir])?;
    etcd.include_imports(true);
    for f in etcd_files {
        etcd.open_file(proto_dir.join(f))?;
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .emit_rerun_if_changed(false)
        .compile_fds(etcd.file_descriptor_set())?;
    Ok(())
}
