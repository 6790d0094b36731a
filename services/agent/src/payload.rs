//! A write's bytes as they were received: one buffer (tonic's decode of a
//! `WriteRequest`) or a chain of slices of the HTTP/2 frames that carried
//! it (the Write fast path). Never copied on its way to the device: the
//! queue hands the slices to `pwritev` as they are.

use tonic::codegen::Bytes;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Payload {
    parts: Vec<Bytes>,
    len: usize,
}

impl Payload {
    /// Empty slices are dropped: they would only lengthen the iovec.
    pub fn from_parts(parts: Vec<Bytes>) -> Payload {
        let parts: Vec<Bytes> = parts.into_iter().filter(|p| !p.is_empty()).collect();
        let len = parts.iter().map(Bytes::len).sum();
        Payload { parts, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slices in order.
    pub fn slices(&self) -> impl Iterator<Item = &[u8]> {
        self.parts.iter().map(|p| &p[..])
    }

    /// One contiguous slice, when the payload is one.
    pub fn as_single(&self) -> Option<&[u8]> {
        match self.parts.as_slice() {
            [] => Some(&[]),
            [one] => Some(one),
            _ => None,
        }
    }
}

impl From<Bytes> for Payload {
    fn from(b: Bytes) -> Payload {
        Payload::from_parts(vec![b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_keeps_order_and_drops_empty_parts() {
        let p = Payload::from_parts(vec![
            Bytes::from_static(b"ab"),
            Bytes::new(),
            Bytes::from_static(b"cde"),
        ]);
        assert_eq!(p.len(), 5);
        assert_eq!(p.slices().count(), 2);
        assert_eq!(p.as_single(), None);
        assert_eq!(p.slices().collect::<Vec<_>>().concat(), b"abcde");
        let one = Payload::from(Bytes::from_static(b"xyz"));
        assert_eq!(one.as_single(), Some(&b"xyz"[..]));
        assert!(Payload::default().is_empty());
    }
}
