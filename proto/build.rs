//! Compiles aliquot/v1/*.proto with protox (pure Rust), so no protoc is needed.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files =
        ["common", "allocator", "agent", "metrics"].map(|f| format!("aliquot/v1/{f}.proto"));
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(&files, ["."])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    // compile_fds() ignores file_descriptor_set_path(): write the set for reflection ourselves.
    std::fs::write(
        out_dir.join("aliquot_descriptor.bin"),
        protox::prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        // Block payloads as `bytes::Bytes`: the server decodes them as a view
        // of the received buffer, not a copy (one memcpy less per MiB).
        .bytes(".aliquot.v1.WriteRequest.data")
        .bytes(".aliquot.v1.ReadReply.data")
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
