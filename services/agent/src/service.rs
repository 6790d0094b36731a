//! The `VdevAgent` gRPC service: a thin edge over [`Agent`], where agent
//! errors become `tonic::Status` (once, via `From<AgentError>`).

use aliquot_proto::v1::vdev_agent_server::VdevAgent;
use aliquot_proto::v1::{
    AgentStats, AgentTunables, CopyFromReply, CopyFromRequest, FlushReply, FlushRequest,
    GetStatsRequest, ReadReply, ReadRequest, WriteBatchReply, WriteBatchRequest, WriteReply,
    WriteRequest,
};
use tonic::{Request, Response, Status};

use crate::agent::Agent;
use crate::copy::{Copier, Fletcher4};

pub struct VdevAgentService {
    agent: Agent,
    copier: Copier,
}

/// Who reads: a client, or another agent copying a block for a move.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reader {
    Client,
    /// Yields to client I/O first, is counted as a move's I/O, and is
    /// answered with the bytes' Fletcher-4 for the copier to check.
    Move,
}

impl VdevAgentService {
    pub fn new(agent: Agent, copier: Copier) -> Self {
        VdevAgentService { agent, copier }
    }

    /// Read and ReadForCopy: the read token checked against the range,
    /// then the bytes read.
    async fn checked_read(
        &self,
        req: ReadRequest,
        reader: Reader,
    ) -> Result<Response<ReadReply>, Status> {
        let ReadRequest {
            offset,
            size,
            token,
        } = req;
        self.agent
            .gate()
            .check_read(&token, self.agent.vdev(), offset, size)?;
        let (data, fletcher4) = match reader {
            Reader::Client => (self.agent.read(offset, size).await?, Vec::new()),
            Reader::Move => {
                self.agent
                    .yield_to_clients(crate::copy::YIELD_AT_MOST, crate::copy::YIELD_STEP)
                    .await;
                let data = self.agent.as_move(self.agent.read(offset, size)).await?;
                let sum = Fletcher4::of(&data).to_bytes();
                (data, sum)
            }
        };
        Ok(Response::new(ReadReply {
            data: data.into(),
            fletcher4,
        }))
    }
}

#[tonic::async_trait]
impl VdevAgent for VdevAgentService {
    #[tracing::instrument(skip_all, fields(
        vdev = self.agent.vdev(),
        offset = req.get_ref().offset,
        len = req.get_ref().data.len(),
        aggregated_ios,
    ))]
    async fn write(&self, req: Request<WriteRequest>) -> Result<Response<WriteReply>, Status> {
        let WriteRequest {
            offset,
            data,
            token,
        } = req.into_inner();
        let bytes = data.len() as u64;
        let aggregated_ios = self.agent.write_with_token(&token, offset, data).await?;
        tracing::Span::current().record("aggregated_ios", aggregated_ios);
        Ok(Response::new(WriteReply {
            bytes,
            aggregated_ios,
        }))
    }

    #[tracing::instrument(skip_all, fields(
        vdev = self.agent.vdev(),
        writes = req.get_ref().writes.len(),
    ))]
    async fn write_batch(
        &self,
        req: Request<WriteBatchRequest>,
    ) -> Result<Response<WriteBatchReply>, Status> {
        let writes = req.into_inner().writes;
        let lens: Vec<u64> = writes.iter().map(|w| w.data.len() as u64).collect();
        let aggregated = self
            .agent
            .write_batch_with_token(
                writes
                    .into_iter()
                    .map(|w| (w.token, w.offset, w.data))
                    .collect(),
            )
            .await?;
        let results = lens
            .into_iter()
            .zip(aggregated)
            .map(|(bytes, aggregated_ios)| WriteReply {
                bytes,
                aggregated_ios,
            })
            .collect();
        Ok(Response::new(WriteBatchReply { results }))
    }

    #[tracing::instrument(skip_all, fields(
        vdev = self.agent.vdev(),
        offset = req.get_ref().offset,
        size = req.get_ref().size,
    ))]
    async fn read(&self, req: Request<ReadRequest>) -> Result<Response<ReadReply>, Status> {
        self.checked_read(req.into_inner(), Reader::Client).await
    }

    #[tracing::instrument(skip_all, fields(
        vdev = self.agent.vdev(),
        offset = req.get_ref().offset,
        size = req.get_ref().size,
    ))]
    async fn read_for_copy(
        &self,
        req: Request<ReadRequest>,
    ) -> Result<Response<ReadReply>, Status> {
        self.checked_read(req.into_inner(), Reader::Move).await
    }

    #[tracing::instrument(skip_all, fields(
        vdev = self.agent.vdev(),
        source = %req.get_ref().source_endpoint,
        offset = req.get_ref().offset,
        size = req.get_ref().size,
    ))]
    async fn copy_from(
        &self,
        req: Request<CopyFromRequest>,
    ) -> Result<Response<CopyFromReply>, Status> {
        Ok(Response::new(
            self.copier.copy(&self.agent, req.into_inner()).await?,
        ))
    }

    #[tracing::instrument(skip_all, fields(vdev = self.agent.vdev()))]
    async fn flush(&self, _req: Request<FlushRequest>) -> Result<Response<FlushReply>, Status> {
        self.agent.flush().await?;
        Ok(Response::new(FlushReply {}))
    }

    #[tracing::instrument(skip_all, fields(vdev = self.agent.vdev()))]
    async fn get_stats(
        &self,
        _req: Request<GetStatsRequest>,
    ) -> Result<Response<AgentStats>, Status> {
        Ok(Response::new(self.agent.stats()))
    }

    #[tracing::instrument(skip_all, fields(
        vdev = self.agent.vdev(),
        zfs_vdev_aggregation_limit = req.get_ref().zfs_vdev_aggregation_limit,
        zio_taskq_batch_pct = req.get_ref().zio_taskq_batch_pct,
    ))]
    async fn set_tunables(
        &self,
        req: Request<AgentTunables>,
    ) -> Result<Response<AgentTunables>, Status> {
        Ok(Response::new(self.agent.set_tunables(req.get_ref())?))
    }
}
