//! A TCP proxy between allocators and PostgreSQL that pauses the path the
//! way a partition does, in the middle of a transaction: the fault behind
//! the takeover tests (`ha.rs`) and the PostgreSQL crash runs (`crash.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A TCP proxy between allocators and PostgreSQL that can cut the path in
/// the middle of a transaction: armed, it lets the next `BEGIN` and the
/// statement after it through (a txg's transaction holding the `leaders`
/// row), then forwards nothing more, either way, on any of its
/// connections until thawed, as a partition would.
pub struct PgProxy {
    port: u16,
    armed: Arc<AtomicBool>,
    frozen: Arc<tokio::sync::watch::Sender<bool>>,
    task: tokio::task::JoinHandle<()>,
}

impl PgProxy {
    pub async fn start(pg_port: u16) -> PgProxy {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let frozen = Arc::new(tokio::sync::watch::Sender::new(false));
        let (a, f) = (armed.clone(), frozen.clone());
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((client, _)) = l.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", pg_port)).await
                else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                conns.spawn(PgProxy::pipe(cr, sw, Some(a.clone()), f.clone()));
                conns.spawn(PgProxy::pipe(sr, cw, None, f.clone()));
            }
        });
        PgProxy {
            port,
            armed,
            frozen,
            task,
        }
    }

    /// Copy `from` to `to` while not frozen; on the client's side
    /// (`armed` given), freeze after a `BEGIN` and the message after it.
    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        armed: Option<Arc<AtomicBool>>,
        frozen: Arc<tokio::sync::watch::Sender<bool>>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut thawed = frozen.subscribe();
        let mut buf = vec![0u8; 64 << 10];
        let mut began = false;
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let chunk = &buf[..n];
            let mut cut_after = false;
            if let Some(armed) = &armed
                && armed.load(Ordering::Acquire)
            {
                // sqlx begins with a simple query: 'Q' … "BEGIN".
                if chunk[0] == b'Q' && chunk.windows(5).any(|w| w == b"BEGIN") {
                    began = true;
                } else if began && armed.swap(false, Ordering::AcqRel) {
                    cut_after = true;
                }
            }
            if cut_after {
                // Frozen before the statement goes out: its answer is held.
                frozen.send_replace(true);
            } else if thawed.wait_for(|f| !*f).await.is_err() {
                return;
            }
            if to.write_all(chunk).await.is_err() {
                return;
            }
        }
    }

    pub fn url(&self) -> String {
        format!("postgres://aliquot@127.0.0.1:{}/postgres", self.port)
    }

    pub fn arm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    pub async fn wait_frozen(&self, within: Duration) {
        let mut rx = self.frozen.subscribe();
        tokio::time::timeout(within, rx.wait_for(|f| *f))
            .await
            .expect("no transaction began through the proxy")
            .unwrap();
    }

    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.thaw();
        self.task.abort();
    }
}
