//! The Write fast path against tonic's own decoding, over real gRPC on
//! loopback: two agents on file devices, one with `--no-fast-write`, get the
//! same writes and the same bad requests. Every write reads back, every
//! refusal is the same (code, message, details), and the fast path really
//! served the first agent's writes.

mod common;

use aliquot_agent::Agent;
use aliquot_proto::v1::WriteRequest;
use common::{Running, file_config, pattern, start_agent};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::Bytes;
use tonic::{Code, Status};

const MIB: u64 = 1 << 20;

async fn agent(dir: &std::path::Path, name: &str, fast: bool) -> (Agent, Running) {
    let mut cfg = file_config(&dir.join(name), 64 * MIB);
    cfg.no_fast_write = !fast;
    let agent = Agent::open(&cfg).expect("open agent");
    let running = start_agent(agent.clone(), cfg).await;
    (agent, running)
}

/// A refusal as a client sees it.
fn refusal(st: &Status) -> (Code, String, Vec<u8>) {
    (st.code(), st.message().to_owned(), st.details().to_vec())
}

/// Sends pre-encoded bytes as the request message: malformed protobuf
/// that a generated client cannot produce.
#[derive(Clone, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        use prost::bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

async fn raw_write(r: &Running, msg: Bytes) -> Result<Bytes, Status> {
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", r.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.unwrap();
    grpc.unary(
        tonic::Request::new(msg),
        "/aliquot.v1.VdevAgent/Write".parse().unwrap(),
        RawCodec,
    )
    .await
    .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fast_path_writes_and_refuses_exactly_as_tonic_does() {
    let dir = tempfile::tempdir().unwrap();
    let (fast_agent, mut fast) = agent(dir.path(), "fast.img", true).await;
    let (slow_agent, mut slow) = agent(dir.path(), "slow.img", false).await;

    // Writes of every size class read back the same on both, including
    // 16 MiB (the largest block: many HTTP/2 frames) and contiguous 4 KiB
    // writes (which the queue may merge into one pwritev).
    let writes: Vec<(u64, Vec<u8>)> = vec![
        (0, pattern(4096, 1)),
        (4096, pattern(4096, 2)),
        (MIB, pattern(MIB as usize, 3)),
        (4 * MIB, pattern(128 << 10, 4)),
        (8 * MIB, pattern(16 * MIB as usize, 5)),
    ];
    for (off, data) in &writes {
        let a = fast.write(*off, data.clone()).await.unwrap();
        let b = slow.write(*off, data.clone()).await.unwrap();
        assert!(a >= 1 && b >= 1);
    }
    for (off, data) in &writes {
        assert_eq!(&fast.read(*off, data.len() as u64).await.unwrap(), data);
        assert_eq!(&slow.read(*off, data.len() as u64).await.unwrap(), data);
    }
    let fast_stats = fast.stats().await;
    assert_eq!(fast_stats.bytes_written, slow.stats().await.bytes_written);
    assert_eq!(
        fast_agent.fast_writes(),
        writes.len() as u64,
        "the fast path served every valid unary write"
    );
    assert_eq!(slow_agent.fast_writes(), 0, "--no-fast-write");

    // Refusals: the agent's own (range, size, alignment) and tonic's (a
    // message over the decode limit, malformed protobuf, two messages).
    let cap = fast_stats.capacity;
    let bad: Vec<(&str, u64, usize)> = vec![
        ("unaligned offset", 512, 4096),
        ("unaligned size", 0, 4097),
        ("empty", 0, 0),
        ("past the end", cap, 4096),
        ("over 16 MiB, under the message limit", 0, (16 << 20) + 4096),
        ("over the message limit", 0, 17 << 20),
    ];
    for (what, off, len) in bad {
        let a = fast.write(off, vec![0xEE; len]).await.expect_err(what);
        let b = slow.write(off, vec![0xEE; len]).await.expect_err(what);
        assert_eq!(refusal(&a), refusal(&b), "{what}");
        assert_ne!(a.code(), Code::Ok);
    }
    let mut two = Vec::new();
    {
        use prost::Message;
        let one = WriteRequest {
            offset: 40 * MIB,
            data: vec![1u8; 4096].into(),
            token: vec![],
        }
        .encode_to_vec();
        two.extend_from_slice(&one);
        two.extend_from_slice(&one);
    }
    let raw_cases: Vec<(&str, Bytes)> = vec![
        (
            "data with a varint wire type",
            Bytes::from_static(&[0x10, 1]),
        ),
        ("a group", Bytes::from_static(&[0x0b, 0x0c])),
        ("field 0", Bytes::from_static(&[0x00, 1])),
        (
            "a length past the end",
            Bytes::from_static(&[0x12, 10, 1, 2]),
        ),
    ];
    for (what, msg) in raw_cases {
        let a = raw_write(&fast, msg.clone()).await.expect_err(what);
        let b = raw_write(&slow, msg).await.expect_err(what);
        assert_eq!(refusal(&a), refusal(&b), "{what}");
    }
    // Repeated fields: proto3 keeps the last; both agents agree on the write.
    let a = raw_write(&fast, Bytes::from(two.clone())).await.map(|_| ());
    let b = raw_write(&slow, Bytes::from(two)).await.map(|_| ());
    assert_eq!(
        a.map_err(|e| refusal(&e)),
        b.map_err(|e| refusal(&e)),
        "concatenated messages"
    );

    // Nothing refused reached either device; the data is unchanged.
    assert_eq!(fast.stats().await.write_errors, 0);
    for (off, data) in &writes[..2] {
        assert_eq!(&fast.read(*off, data.len() as u64).await.unwrap(), data);
    }
    fast.stop().await;
    slow.stop().await;
}
