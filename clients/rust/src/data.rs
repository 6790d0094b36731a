//! A block's bytes on their way to an agent. `VdevAgent.Write` is sent with
//! an encoder of its own: the same `WriteRequest` on the wire, but the
//! block's bytes are generated (or copied) straight into the request's
//! encode buffer by a [`BlockData`], instead of into a buffer of their own
//! that prost then copies (a memory pass less per byte, on the client's
//! critical path). An extent may be larger than its block (rounded up to
//! the vdev's sector size): it is written whole.

use aliquot_proto::v1::WriteReply;
use prost::Message as _;
use prost::bytes::{BufMut, Bytes};
use prost::encoding::{WireType, encode_key, encode_varint};
use telemetry::{TraceInjector, TracedChannel};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

use crate::connect::MAX_MESSAGE;

/// What a block holds: `put` appends its first `len` bytes (the extent's
/// size, at least [`BlockData::len`]) to an encode buffer.
pub trait BlockData: Clone + Send + Sync + 'static {
    /// The block's size in bytes (what is allocated).
    fn len(&self) -> u64;
    /// Whether the block is empty (never allocatable).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Append the first `len` bytes of the extent's contents to `dst`.
    fn put<B: BufMut>(&self, dst: &mut B, len: usize);
    /// The first `len` bytes as one buffer (for batched agent writes).
    fn to_bytes(&self, len: usize) -> Bytes {
        let mut v = Vec::with_capacity(len);
        self.put(&mut v, len);
        v.into()
    }
}

/// User data: the bytes, then zeros to the end of the extent.
impl BlockData for Bytes {
    fn len(&self) -> u64 {
        Bytes::len(self) as u64
    }
    fn put<B: BufMut>(&self, dst: &mut B, len: usize) {
        let n = len.min(Bytes::len(self));
        dst.put_slice(&self[..n]);
        dst.put_bytes(0, len - n);
    }
    fn to_bytes(&self, len: usize) -> Bytes {
        if len == Bytes::len(self) {
            return self.clone();
        }
        let mut v = Vec::with_capacity(len);
        self.put(&mut v, len);
        v.into()
    }
}

/// `VdevAgent.Write` of a [`BlockData`] (see the module comment).
pub struct DataWriter {
    grpc: tonic::client::Grpc<TracedChannel>,
}

impl DataWriter {
    /// A writer on the agent channel `ch`.
    pub fn new(ch: Channel) -> DataWriter {
        DataWriter {
            grpc: tonic::client::Grpc::new(TracedChannel::new(ch, TraceInjector))
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        }
    }

    /// `Write { offset, data, token }` where `data` is the first `len`
    /// bytes of `data`'s contents.
    pub async fn write<D: BlockData>(
        &mut self,
        w: DataWrite<D>,
    ) -> Result<WriteReply, tonic::Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("agent connection: {e}")))?;
        let mut req = tonic::Request::new(w);
        req.extensions_mut()
            .insert(tonic::GrpcMethod::new("aliquot.v1.VdevAgent", "Write"));
        let path = PathAndQuery::from_static("/aliquot.v1.VdevAgent/Write");
        self.grpc
            .unary(req, path, DataCodec(std::marker::PhantomData))
            .await
            .map(tonic::Response::into_inner)
    }
}

/// A `WriteRequest` whose data is encoded from a [`BlockData`].
#[derive(Clone, Debug)]
pub struct DataWrite<D> {
    pub offset: u64,
    /// Bytes to write: the extent's size.
    pub len: usize,
    pub data: D,
    /// The extent's write token from the Allocate reply (empty: none given).
    pub token: Vec<u8>,
}

/// Encodes [`DataWrite`] as `aliquot.v1.WriteRequest` (offset = 1,
/// data = 2, token = 3), decodes `WriteReply` with prost.
struct DataCodec<D>(std::marker::PhantomData<D>);

impl<D: BlockData> Codec for DataCodec<D> {
    type Encode = DataWrite<D>;
    type Decode = WriteReply;
    type Encoder = DataEncoder<D>;
    type Decoder = ReplyDecoder;
    fn encoder(&mut self) -> DataEncoder<D> {
        DataEncoder(std::marker::PhantomData)
    }
    fn decoder(&mut self) -> ReplyDecoder {
        ReplyDecoder
    }
}

struct DataEncoder<D>(std::marker::PhantomData<D>);

impl<D: BlockData> Encoder for DataEncoder<D> {
    type Item = DataWrite<D>;
    type Error = tonic::Status;

    fn encode(&mut self, w: DataWrite<D>, buf: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        // Room for both keys and varints too: one allocation, no regrowth.
        buf.reserve(w.len + w.token.len() + 32);
        if w.offset != 0 {
            encode_key(1, WireType::Varint, buf);
            encode_varint(w.offset, buf);
        }
        if w.len != 0 {
            encode_key(2, WireType::LengthDelimited, buf);
            encode_varint(w.len as u64, buf);
            w.data.put(buf, w.len);
        }
        if !w.token.is_empty() {
            encode_key(3, WireType::LengthDelimited, buf);
            encode_varint(w.token.len() as u64, buf);
            buf.put_slice(&w.token);
        }
        Ok(())
    }
}

struct ReplyDecoder;

impl Decoder for ReplyDecoder {
    type Item = WriteReply;
    type Error = tonic::Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<WriteReply>, tonic::Status> {
        WriteReply::decode(buf)
            .map(Some)
            .map_err(|e| tonic::Status::internal(format!("cannot decode WriteReply: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_is_padded_to_the_extent() {
        let b = Bytes::from_static(b"abc");
        assert_eq!(&b.to_bytes(5)[..], b"abc\0\0");
        assert_eq!(b.to_bytes(3), b);
        let mut v = Vec::new();
        b.put(&mut v, 4);
        assert_eq!(v, b"abc\0");
    }
}
