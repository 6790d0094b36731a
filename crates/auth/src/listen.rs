//! Accepting connections so that no peer can exhaust a server. Every server
//! (allocator, agents, metrics gRPC and HTTP, the Prometheus listeners) accepts
//! through here:
//!
//! * connections in total are capped, and per peer address: plaintext ones
//!   at accept, TLS ones once their handshake finished (connections that
//!   never authenticate must not shut out a client on the same address);
//!   one over a cap is closed at once;
//! * the TLS handshake runs here, not in tonic, so that it is bounded in
//!   time (`handshake_timeout`) and in number (`max_handshakes` pending at
//!   once, `max_handshakes_per_peer` from one address): a new connection
//!   past a bound evicts the oldest pending handshake, so a peer that opens
//!   connections and never sends a ClientHello holds at most that many, for
//!   at most that long, and cannot keep a newcomer from handshaking;
//! * each connection carries a byte budget ([`PeerInfo::budget`]) that the
//!   agent's write path draws on for request bodies it buffers (item 2).
//!
//! tonic then serves the finished streams as plain IO; the role layer reads
//! the client certificate from [`PeerInfo`].

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use telemetry::backoff::Backoff;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

/// Caps on what peers may hold. One set per listener.
#[derive(Clone, Debug)]
pub struct ListenLimits {
    /// A TLS handshake not finished in this time is dropped.
    pub handshake_timeout: Duration,
    /// TLS handshakes in progress at once; a new one beyond evicts the
    /// oldest.
    pub max_handshakes: usize,
    /// TLS handshakes in progress at once from one IP address (a new one
    /// beyond evicts that address's oldest): one peer cannot take every
    /// handshake slot.
    pub max_handshakes_per_peer: usize,
    /// Open connections from one IP address (under TLS: those past their
    /// handshake).
    pub max_per_peer: usize,
    /// Open connections in total (kept below the file-descriptor limit).
    pub max_connections: usize,
    /// Bytes of incomplete request bodies one connection may hold buffered.
    pub connection_buffer: usize,
    /// The process's file-descriptor limit, as found (for the log).
    pub fd_limit: u64,
}

impl Default for ListenLimits {
    fn default() -> Self {
        ListenLimits {
            handshake_timeout: Duration::from_secs(10),
            max_handshakes: 256,
            max_handshakes_per_peer: 16,
            max_per_peer: 512,
            max_connections: 4096,
            connection_buffer: 256 << 20,
            fd_limit: 0,
        }
    }
}

impl ListenLimits {
    /// The defaults, with `max_connections` fitted under the process's
    /// file-descriptor limit (raised to the hard limit first, where allowed):
    /// a quarter of the descriptors stay for files, the store and outbound
    /// connections. Logs what it found.
    fn fitted() -> ListenLimits {
        let (soft, _hard) = raise_fd_limit();
        let mut l = ListenLimits::default();
        let usable = soft.saturating_sub(soft / 4).saturating_sub(64) as usize;
        l.max_connections = l.max_connections.min(usable.max(16));
        l.max_per_peer = l.max_per_peer.min(l.max_connections);
        l.max_handshakes = l.max_handshakes.min(l.max_connections);
        l.fd_limit = soft;
        l
    }
}

/// The caps as flags (each also an `ALIQUOT_*` variable); unset ones take
/// [`ListenLimits::fitted`]'s values.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ListenArgs {
    /// A TLS handshake not finished within this is dropped (default 10s).
    #[arg(long, env = "ALIQUOT_HANDSHAKE_TIMEOUT", value_parser = units::duration_arg)]
    pub handshake_timeout: Option<Duration>,
    /// TLS handshakes in progress at once; a new one beyond evicts the
    /// oldest pending (default 256).
    #[arg(long, env = "ALIQUOT_MAX_HANDSHAKES")]
    pub max_handshakes: Option<usize>,
    /// TLS handshakes in progress at once from one IP address; a new one
    /// beyond evicts that address's oldest pending (default 16).
    #[arg(long, env = "ALIQUOT_MAX_HANDSHAKES_PER_PEER")]
    pub max_handshakes_per_peer: Option<usize>,
    /// Open connections from one IP address; under TLS only those past
    /// their handshake count (default 512).
    #[arg(long, env = "ALIQUOT_MAX_CONNECTIONS_PER_PEER")]
    pub max_connections_per_peer: Option<usize>,
    /// Open connections in total (default 4096, and at most three quarters
    /// of the file-descriptor limit, which is raised to its hard limit).
    #[arg(long, env = "ALIQUOT_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
}

impl ListenArgs {
    pub fn limits(&self) -> ListenLimits {
        let mut l = ListenLimits::fitted();
        if let Some(t) = self.handshake_timeout {
            l.handshake_timeout = t;
        }
        if let Some(n) = self.max_handshakes {
            l.max_handshakes = n.max(1);
        }
        if let Some(n) = self.max_handshakes_per_peer {
            l.max_handshakes_per_peer = n.max(1);
        }
        if let Some(n) = self.max_connections_per_peer {
            l.max_per_peer = n.max(1);
        }
        if let Some(n) = self.max_connections {
            l.max_connections = n.max(1);
        }
        l
    }
}

/// Raise RLIMIT_NOFILE's soft limit to its hard limit; returns both after.
pub fn raise_fd_limit() -> (u64, u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return (1024, 1024);
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
    }
    (r.rlim_cur, r.rlim_max)
}

/// What a connection tells the services about its peer.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub remote: SocketAddr,
    /// The client's certificate chain, leaf first (TLS only).
    pub certs: Option<Arc<Vec<CertificateDer<'static>>>>,
    /// Bytes of request bodies this connection may buffer.
    pub budget: Budget,
}

/// A byte budget: permits are bytes; `size` is what they sum to when
/// nothing is held (a reservation never asks for more than that).
#[derive(Clone, Debug)]
pub struct Budget {
    pub bytes: Arc<Semaphore>,
    pub size: usize,
}

impl Budget {
    pub fn new(size: usize) -> Budget {
        let size = size.min(Semaphore::MAX_PERMITS).min(u32::MAX as usize);
        Budget {
            bytes: Arc::new(Semaphore::new(size)),
            size,
        }
    }

    /// `n` bytes (at most the whole budget), waiting for room.
    pub async fn reserve(&self, n: usize) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let n = n.min(self.size) as u32;
        self.bytes.clone().acquire_many_owned(n).await.ok()
    }
}

/// Counts of what the caps turned away, for tests and logs.
#[derive(Debug, Default)]
pub struct Refusals {
    pub per_peer: AtomicU64,
    pub total: AtomicU64,
    pub handshakes_busy: AtomicU64,
    pub handshakes_failed: AtomicU64,
}

/// Open connections, per peer and in total; handshakes in progress.
#[derive(Debug, Default)]
struct Ledger {
    per_peer: Mutex<HashMap<IpAddr, usize>>,
    total: AtomicUsize,
    pending: Mutex<Pending>,
}

/// TLS handshakes in progress, oldest first. They do not count against
/// the per-peer cap (an unauthenticated connection must not shut out an
/// authenticated client from the same address); they have bounds of their
/// own, per peer and in all, and a new one past a bound evicts the oldest
/// (a connection that never finishes its handshake loses its place to one
/// that may).
#[derive(Debug, Default)]
struct Pending {
    next: u64,
    order: std::collections::BTreeMap<u64, (IpAddr, tokio::sync::oneshot::Sender<()>)>,
    per_peer: HashMap<IpAddr, usize>,
}

impl Pending {
    /// Room for a handshake from `peer`, evicting the oldest past a bound;
    /// its id and how many were evicted.
    fn admit(
        &mut self,
        peer: IpAddr,
        limits: &ListenLimits,
    ) -> (u64, tokio::sync::oneshot::Receiver<()>, u64) {
        let mut evicted = 0;
        if self.per_peer.get(&peer).copied().unwrap_or(0) >= limits.max_handshakes_per_peer {
            let oldest = self
                .order
                .iter()
                .find(|(_, (p, _))| *p == peer)
                .map(|(id, _)| *id);
            if let Some(id) = oldest {
                self.remove(id);
                evicted += 1;
            }
        }
        if self.order.len() >= limits.max_handshakes
            && let Some(&id) = self.order.keys().next()
        {
            self.remove(id);
            evicted += 1;
        }
        let id = self.next;
        self.next += 1;
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.order.insert(id, (peer, tx));
        *self.per_peer.entry(peer).or_default() += 1;
        (id, rx, evicted)
    }

    /// The handshake ended (or was evicted: dropping its sender ends it).
    fn remove(&mut self, id: u64) {
        if let Some((peer, _)) = self.order.remove(&id)
            && let Some(n) = self.per_peer.get_mut(&peer)
        {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&peer);
            }
        }
    }
}

/// One open connection's place in the ledger, given back on drop.
#[derive(Debug)]
struct Slot {
    ledger: Arc<Ledger>,
    peer: IpAddr,
    /// Counted against the per-peer cap (under TLS: once its handshake
    /// finished).
    per_peer: bool,
}

impl Slot {
    /// Count the connection against its peer's cap; false when full.
    fn take_per_peer(&mut self, max: usize) -> bool {
        let mut m = self
            .ledger
            .per_peer
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let n = m.entry(self.peer).or_default();
        if *n >= max {
            return false;
        }
        *n += 1;
        self.per_peer = true;
        true
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.ledger.total.fetch_sub(1, Ordering::Relaxed);
        if !self.per_peer {
            return;
        }
        let mut m = self
            .ledger
            .per_peer
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.peer);
            }
        }
    }
}

/// A TCP listener that enforces the connection caps.
pub struct GuardedListener {
    inner: TcpListener,
    limits: ListenLimits,
    ledger: Arc<Ledger>,
    refusals: Arc<Refusals>,
}

impl GuardedListener {
    pub fn new(inner: TcpListener, limits: ListenLimits) -> GuardedListener {
        tracing::info!(
            addr = ?inner.local_addr().ok(),
            fd_limit = limits.fd_limit,
            max_connections = limits.max_connections,
            max_per_peer = limits.max_per_peer,
            max_handshakes = limits.max_handshakes,
            max_handshakes_per_peer = limits.max_handshakes_per_peer,
            handshake_timeout_ms = limits.handshake_timeout.as_millis() as u64,
            "connection limits"
        );
        GuardedListener {
            inner,
            limits,
            ledger: Arc::default(),
            refusals: Arc::default(),
        }
    }

    pub fn refusals(&self) -> Arc<Refusals> {
        self.refusals.clone()
    }

    /// The next connection within the caps; those over them are closed.
    /// `per_peer`: count it against its peer's cap now (plaintext; under
    /// TLS that waits for the finished handshake).
    async fn accept_counted(&self, per_peer: bool) -> (TcpStream, SocketAddr, Slot) {
        // Starts afresh per accepted connection: only a run of failures
        // stretches the pause.
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        loop {
            let (s, addr) = match self.inner.accept().await {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: wait for descriptors to come back
                    // rather than spin, longer while they stay gone.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            };
            let peer = addr.ip();
            if self.ledger.total.load(Ordering::Relaxed) >= self.limits.max_connections {
                self.refused(&self.refusals.total, peer, "max_connections");
                continue;
            }
            let mut slot = Slot {
                ledger: self.ledger.clone(),
                peer,
                per_peer: false,
            };
            self.ledger.total.fetch_add(1, Ordering::Relaxed);
            if per_peer && !slot.take_per_peer(self.limits.max_per_peer) {
                self.refused(&self.refusals.per_peer, peer, "max_per_peer");
                continue;
            }
            let _ = s.set_nodelay(true);
            return (s, addr, slot);
        }
    }

    fn refused(&self, counter: &AtomicU64, peer: IpAddr, cap: &'static str) {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        // The first, then every 1024th: an attack must not flood the log.
        if n.is_multiple_of(1024) {
            tracing::warn!(%peer, cap, refused = n + 1, "connection refused at a cap");
        }
    }

    /// Connections for a gRPC server, TLS finished here when `tls` is
    /// given. Ends when the receiver is dropped.
    pub fn incoming(self, tls: Option<Arc<ServerConfig>>) -> ReceiverStream<io::Result<Conn>> {
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(self.run(tls, tx));
        ReceiverStream::new(rx)
    }

    async fn run(self, tls: Option<Arc<ServerConfig>>, tx: mpsc::Sender<io::Result<Conn>>) {
        let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
        loop {
            let (s, remote, mut slot) = tokio::select! {
                c = self.accept_counted(acceptor.is_none()) => c,
                _ = tx.closed() => return,
            };
            let budget = Budget::new(self.limits.connection_buffer);
            let Some(acceptor) = &acceptor else {
                let conn = Conn {
                    io: Io::Plain(s),
                    info: PeerInfo {
                        remote,
                        certs: None,
                        budget,
                    },
                    _slot: slot,
                };
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
                continue;
            };
            let (id, mut evict, evicted) = self
                .ledger
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .admit(remote.ip(), &self.limits);
            for _ in 0..evicted {
                self.refused(
                    &self.refusals.handshakes_busy,
                    remote.ip(),
                    "max_handshakes (the oldest pending handshake evicted)",
                );
            }
            let (acceptor, tx, timeout) =
                (acceptor.clone(), tx.clone(), self.limits.handshake_timeout);
            let (refusals, ledger, max_per_peer) = (
                self.refusals.clone(),
                self.ledger.clone(),
                self.limits.max_per_peer,
            );
            tokio::spawn(async move {
                let done = tokio::select! {
                    r = tokio::time::timeout(timeout, acceptor.accept(s)) => Some(r),
                    _ = &mut evict => None,
                };
                ledger
                    .pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(id);
                let tls = match done {
                    None => {
                        tracing::debug!(%remote, "TLS handshake evicted by a newer one");
                        return;
                    }
                    Some(Ok(Ok(tls))) => tls,
                    Some(Ok(Err(e))) => {
                        refusals.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%remote, error = %e, "TLS handshake failed");
                        return;
                    }
                    Some(Err(_)) => {
                        refusals.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%remote, "TLS handshake timed out");
                        return;
                    }
                };
                // Established: now it counts against its peer's cap.
                if !slot.take_per_peer(max_per_peer) {
                    refusals.per_peer.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%remote, "connection refused at max_per_peer after its handshake");
                    return;
                }
                let certs = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .map(|c| Arc::new(c.iter().map(|c| c.clone().into_owned()).collect()));
                let conn = Conn {
                    io: Io::Tls(Box::new(tls)),
                    info: PeerInfo {
                        remote,
                        certs,
                        budget,
                    },
                    _slot: slot,
                };
                let _ = tx.send(Ok(conn)).await;
            });
        }
    }
}

/// An HTTP listener (axum) under the same caps; plaintext.
impl axum_listener::Listener for GuardedListener {
    type Io = Counted;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Counted, SocketAddr) {
        let (s, addr, slot) = self.accept_counted(true).await;
        (Counted { io: s, _slot: slot }, addr)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// axum's `Listener` trait, re-exported under a name that says what for.
mod axum_listener {
    pub use axum::serve::Listener;
}

/// A plain TCP stream holding its place in the ledger.
pub struct Counted {
    io: TcpStream,
    _slot: Slot,
}

enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// An accepted connection (TLS finished, if any) for tonic.
pub struct Conn {
    io: Io,
    info: PeerInfo,
    _slot: Slot,
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

/// The stream under a [`Conn`], pinned for one poll.
fn conn_io(c: &mut Conn) -> Pin<&mut (dyn AsyncReadWrite + Send)> {
    match &mut c.io {
        Io::Plain(s) => Pin::new(s),
        Io::Tls(s) => Pin::new(s.as_mut()),
    }
}

fn counted_io(c: &mut Counted) -> Pin<&mut (dyn AsyncReadWrite + Send)> {
    Pin::new(&mut c.io)
}

trait AsyncReadWrite: AsyncRead + AsyncWrite + Unpin {}
impl<T: AsyncRead + AsyncWrite + Unpin> AsyncReadWrite for T {}

macro_rules! delegate_io {
    ($t:ty, $inner:path) => {
        impl AsyncRead for $t {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                $inner(self.get_mut()).poll_read(cx, buf)
            }
        }
        impl AsyncWrite for $t {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                $inner(self.get_mut()).poll_write(cx, buf)
            }
            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                $inner(self.get_mut()).poll_write_vectored(cx, bufs)
            }
            fn is_write_vectored(&self) -> bool {
                true
            }
            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                $inner(self.get_mut()).poll_flush(cx)
            }
            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                $inner(self.get_mut()).poll_shutdown(cx)
            }
        }
    };
}

delegate_io!(Conn, conn_io);
delegate_io!(Counted, counted_io);

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        listen: ListenArgs,
    }

    #[test]
    fn the_handshake_timeout_takes_every_duration_other_flags_take() {
        for (s, secs) in [
            ("2min", 120.0),
            ("2m", 120.0),
            ("1.5s", 1.5),
            ("500ms", 0.5),
        ] {
            let f = Flags::try_parse_from(["x", "--handshake-timeout", s]).unwrap();
            assert_eq!(
                f.listen.limits().handshake_timeout,
                Duration::from_secs_f64(secs),
                "{s}"
            );
        }
    }
}
