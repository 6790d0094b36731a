//! The allocation throttles: the unified byte-based throttle of OpenZFS
//! #17020 (zfs-2.4.0) and the request-based legacy throttle it replaced
//! (zfs-2.3.0). Both are written as pure functions over plain numbers so the
//! spec's worked examples can be checked bit for bit; `pool` applies them.

pub mod legacy;
pub mod unified;
