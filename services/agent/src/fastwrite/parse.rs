//! The Write fast path's parser: a unary gRPC `WriteRequest` read straight
//! from the received HTTP/2 body frames, the `data` field kept as slices of
//! those frames (`Bytes`, no copy). Anything it does not handle
//! (compression, more or less than one message, wire types it does not
//! skip, truncation, varint overflow) is `None`: the caller then replays
//! the frames to tonic, which gives its own answer or error.

use tonic::codegen::Bytes;

/// A `WriteRequest` whose `data` is a chain of slices of the body frames.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ParsedWrite {
    pub offset: u64,
    pub token: Vec<u8>,
    pub data: Vec<Bytes>,
}

impl ParsedWrite {
    pub fn data_len(&self) -> usize {
        self.data.iter().map(Bytes::len).sum()
    }
}

/// A read position over a chain of frames.
struct Cursor<'a> {
    frames: &'a [Bytes],
    i: usize,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(frames: &'a [Bytes]) -> Self {
        let mut c = Cursor {
            frames,
            i: 0,
            pos: 0,
        };
        c.settle();
        c
    }

    /// Skip exhausted (and empty) frames.
    fn settle(&mut self) {
        while self.i < self.frames.len() && self.pos >= self.frames[self.i].len() {
            self.i += 1;
            self.pos = 0;
        }
    }

    fn at_end(&self) -> bool {
        self.i >= self.frames.len()
    }

    fn remaining(&self) -> usize {
        self.frames[self.i.min(self.frames.len())..]
            .iter()
            .map(Bytes::len)
            .sum::<usize>()
            - if self.at_end() { 0 } else { self.pos }
    }

    fn byte(&mut self) -> Option<u8> {
        let b = *self.frames.get(self.i)?.get(self.pos)?;
        self.pos += 1;
        self.settle();
        Some(b)
    }

    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.byte()?;
            if shift == 63 && b > 1 {
                return None;
            }
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }

    /// The next `n` bytes as slices of the frames (no copy).
    fn take(&mut self, mut n: usize) -> Option<Vec<Bytes>> {
        if n > self.remaining() {
            return None;
        }
        let mut out = Vec::new();
        while n > 0 {
            let f = &self.frames[self.i];
            let k = n.min(f.len() - self.pos);
            out.push(f.slice(self.pos..self.pos + k));
            self.pos += k;
            n -= k;
            self.settle();
        }
        Some(out)
    }
}

/// Parse one uncompressed gRPC message holding a `WriteRequest` from the
/// whole request body (`frames`, in order). `None`: let tonic handle it.
pub fn parse(frames: &[Bytes]) -> Option<ParsedWrite> {
    let mut c = Cursor::new(frames);
    if c.byte()? != 0 {
        return None; // compressed
    }
    let mut len = 0usize;
    for _ in 0..4 {
        len = (len << 8) | usize::from(c.byte()?);
    }
    if c.remaining() != len {
        return None; // truncated, or more than one message
    }
    let mut w = ParsedWrite::default();
    while !c.at_end() {
        let key = c.varint()?;
        let (field, wire) = (key >> 3, key & 7);
        if field == 0 {
            return None;
        }
        match (field, wire) {
            (1, 0) => w.offset = c.varint()?,
            (2, 2) => {
                let n = usize::try_from(c.varint()?).ok()?;
                // proto3: the last occurrence of a scalar field wins.
                w.data = c.take(n)?;
            }
            (3, 2) => {
                let n = usize::try_from(c.varint()?).ok()?;
                w.token = c.take(n)?.concat();
            }
            (1..=3, _) => return None, // a known field with the wrong wire type
            (_, 0) => {
                c.varint()?;
            }
            (_, 1) => {
                c.take(8)?;
            }
            (_, 2) => {
                let n = usize::try_from(c.varint()?).ok()?;
                c.take(n)?;
            }
            (_, 5) => {
                c.take(4)?;
            }
            _ => return None, // groups, invalid wire types: tonic decides
        }
    }
    Some(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use aliquot_proto::v1::WriteRequest;
    use prost::Message;

    fn framed(msg: &[u8]) -> Vec<u8> {
        let mut v = vec![0];
        v.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        v.extend_from_slice(msg);
        v
    }

    fn req() -> WriteRequest {
        WriteRequest {
            offset: 1 << 40 | 12345,
            data: Bytes::from((0..=255u8).cycle().take(300).collect::<Vec<_>>()),
            token: b"tok-en".to_vec(),
        }
    }

    fn check(p: &ParsedWrite, r: &WriteRequest) {
        assert_eq!(p.offset, r.offset);
        assert_eq!(p.token, r.token);
        assert_eq!(p.data.concat(), r.data.to_vec());
    }

    #[test]
    fn whole_message() {
        let r = req();
        let body = Bytes::from(framed(&r.encode_to_vec()));
        check(&parse(&[body]).unwrap(), &r);
    }

    #[test]
    fn split_at_every_boundary() {
        let r = WriteRequest {
            offset: 300,
            data: Bytes::from_static(b"hello world"),
            token: b"t".to_vec(),
        };
        let body = framed(&r.encode_to_vec());
        for a in 0..=body.len() {
            for b in a..=body.len() {
                let frames = [
                    Bytes::copy_from_slice(&body[..a]),
                    Bytes::copy_from_slice(&body[a..b]),
                    Bytes::copy_from_slice(&body[b..]),
                ];
                let p = parse(&frames).unwrap_or_else(|| panic!("split at {a},{b}"));
                check(&p, &r);
            }
        }
    }

    #[test]
    fn data_is_not_copied() {
        let r = req();
        let body = Bytes::from(framed(&r.encode_to_vec()));
        let p = parse(std::slice::from_ref(&body)).unwrap();
        let start = body.as_ptr() as usize;
        let d = p.data[0].as_ptr() as usize;
        assert!(d >= start && d < start + body.len());
    }

    #[test]
    fn fields_in_any_order_and_unknown_fields() {
        let r = req();
        let mut msg = Vec::new();
        // token (3), unknown varint 9, data (2), unknown fixed64 10,
        // unknown len 11, unknown fixed32 12, offset (1)
        prost::encoding::bytes::encode(3, &r.token, &mut msg);
        prost::encoding::uint64::encode(9, &77, &mut msg);
        prost::encoding::bytes::encode(2, &r.data, &mut msg);
        prost::encoding::fixed64::encode(10, &5, &mut msg);
        prost::encoding::string::encode(11, &"x".to_string(), &mut msg);
        prost::encoding::fixed32::encode(12, &6, &mut msg);
        prost::encoding::uint64::encode(1, &r.offset, &mut msg);
        // tonic/prost agree on what it means
        assert_eq!(WriteRequest::decode(&msg[..]).unwrap(), r);
        check(&parse(&[Bytes::from(framed(&msg))]).unwrap(), &r);
    }

    #[test]
    fn refused_input_is_left_to_tonic() {
        let r = req();
        let body = framed(&r.encode_to_vec());
        // truncated anywhere
        for n in 0..body.len() {
            assert_eq!(parse(&[Bytes::copy_from_slice(&body[..n])]), None, "{n}");
        }
        // compressed flag
        let mut c = body.clone();
        c[0] = 1;
        assert_eq!(parse(&[Bytes::from(c)]), None);
        // two messages
        let two = [Bytes::from(body.clone()), Bytes::from(body.clone())];
        assert_eq!(parse(&two), None);
        // wrong wire type for data, a group, field 0, an overlong varint
        for msg in [
            vec![0x10, 1],
            vec![0x0b, 0x0c],
            vec![0x00, 1],
            vec![
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
            ],
        ] {
            assert_eq!(parse(&[Bytes::from(framed(&msg))]), None, "{msg:?}");
        }
        // a data length beyond the message
        assert_eq!(parse(&[Bytes::from(framed(&[0x12, 10, 1, 2]))]), None);
    }

    #[test]
    fn empty_message_is_defaults() {
        assert_eq!(
            parse(&[Bytes::from(framed(&[]))]),
            Some(ParsedWrite::default())
        );
    }
}
