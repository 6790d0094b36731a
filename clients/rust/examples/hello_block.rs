//! Write a block to a pool, read it back, free it.
//!
//! Against a local pool (`aliquotctl up` in another terminal, from the same
//! directory, so its certificates are in aliquot-data/certs):
//!
//! ```sh
//! cargo run -p aliquot-client --example hello_block
//! cargo run -p aliquot-client --example hello_block -- --allocator http://127.0.0.1:7000 --insecure
//! ```

use aliquot_client::bytes::Bytes;
use aliquot_client::{Config, Pool};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// The allocator's endpoint (several: comma-separated).
    #[arg(
        long,
        env = "ALIQUOT_ALLOCATOR",
        default_value = "https://127.0.0.1:7000"
    )]
    allocator: String,
    #[command(flatten)]
    tls: aliquot_auth::ClientTlsArgs,
    /// What to write.
    #[arg(long, default_value = "hello from aliquot-client")]
    text: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let pool = Pool::connect(Config::new(args.allocator, args.tls.resolve()?)).await?;

    let data = Bytes::from(args.text.into_bytes());
    let block = pool.put(&data).await?;
    let txg = pool.sync().await?;
    let at: Vec<String> = block
        .extents
        .iter()
        .map(|e| format!("vdev {} offset {}", e.vdev, e.offset))
        .collect();
    println!(
        "wrote {} bytes at {}; durable in txg {txg}",
        block.len,
        at.join(", ")
    );

    let back = pool.read(&block).await?;
    anyhow::ensure!(back == data, "read back {back:?}, wrote {data:?}");
    println!("read back: {}", String::from_utf8_lossy(&back));

    // Many blocks: pipelined under the throttle, committed together.
    let blocks: Vec<Bytes> = (0..16u8).map(|i| Bytes::from(vec![i; 64 << 10])).collect();
    let placed = pool.put_batch(blocks, None).await?;
    println!("wrote a batch of {} blocks of 64 KiB", placed.len());

    pool.free(&placed).await?;
    pool.free(&[block]).await?;
    println!("freed");
    Ok(())
}
