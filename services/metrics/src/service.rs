//! The `aliquot.v1.Metrics` gRPC service: ingest snapshots, answer History
//! and Summary from the store. Errors become `tonic::Status` here, once.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use aliquot_proto::v1::metrics_server::Metrics;
use aliquot_proto::v1::{
    HistoryReply, HistoryRequest, PoolSnapshot, RecordReply, SnapshotBatch, SummaryReply,
    SummaryRequest,
};
use tonic::{Request, Response, Status, Streaming};

use crate::store::Store;

/// Snapshots per transaction when a client streams them.
const STREAM_CHUNK: usize = 512;

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub struct MetricsService {
    store: Arc<Store>,
}

impl MetricsService {
    pub fn new(store: Arc<Store>) -> Self {
        MetricsService { store }
    }
}

#[tonic::async_trait]
impl Metrics for MetricsService {
    #[tracing::instrument(skip_all, fields(snapshots = tracing::field::Empty, rows = tracing::field::Empty))]
    async fn record_snapshots(
        &self,
        request: Request<Streaming<PoolSnapshot>>,
    ) -> Result<Response<RecordReply>, Status> {
        let mut stream = request.into_inner();
        let mut reply = RecordReply::default();
        let mut buf = Vec::with_capacity(STREAM_CHUNK);
        loop {
            let next = stream.message().await?;
            let done = next.is_none();
            if let Some(s) = next {
                buf.push(s);
            }
            if buf.len() >= STREAM_CHUNK || (done && !buf.is_empty()) {
                let st = self.store.ingest(&buf).await?;
                reply.snapshots += st.snapshots;
                reply.rows += st.rows;
                buf.clear();
            }
            if done {
                break;
            }
        }
        let span = tracing::Span::current();
        span.record("snapshots", reply.snapshots);
        span.record("rows", reply.rows);
        tracing::debug!(
            snapshots = reply.snapshots,
            rows = reply.rows,
            "stream stored"
        );
        Ok(Response::new(reply))
    }

    #[tracing::instrument(skip_all, fields(snapshots = request.get_ref().snapshots.len(), rows = tracing::field::Empty))]
    async fn record_batch(
        &self,
        request: Request<SnapshotBatch>,
    ) -> Result<Response<RecordReply>, Status> {
        let batch = request.into_inner();
        let st = self.store.ingest(&batch.snapshots).await?;
        tracing::Span::current().record("rows", st.rows);
        tracing::debug!(snapshots = st.snapshots, rows = st.rows, "batch stored");
        Ok(Response::new(RecordReply {
            snapshots: st.snapshots,
            rows: st.rows,
        }))
    }

    #[tracing::instrument(skip_all, fields(pool = %request.get_ref().pool, max_points = request.get_ref().max_points))]
    async fn history(
        &self,
        request: Request<HistoryRequest>,
    ) -> Result<Response<HistoryReply>, Status> {
        let reply = self.store.history(request.get_ref()).await?;
        Ok(Response::new(reply))
    }

    #[tracing::instrument(skip_all, fields(pool = %request.get_ref().pool))]
    async fn summary(
        &self,
        request: Request<SummaryRequest>,
    ) -> Result<Response<SummaryReply>, Status> {
        let pools = self
            .store
            .summary(&request.get_ref().pool, now_ms())
            .await?;
        Ok(Response::new(SummaryReply { pools }))
    }
}
