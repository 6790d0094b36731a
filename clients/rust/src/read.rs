//! Reading committed blocks back. Agents that check tokens read only what
//! a read token covers; the allocator grants them for committed extents
//! (ReadTokens), and answers where a block it moved keeping its address
//! lives now. A token an agent refuses because it restarted since the grant
//! is asked for again, once.

use std::collections::HashMap;
use std::time::Duration;

use aliquot_proto::error::reason;
use aliquot_proto::v1::{ErrorReason, Extent, GetPoolRequest, ReadRequest, ReadTokensRequest};
use prost::bytes::Bytes;

use crate::connect::{Agents, Allocator};
use crate::error::{Error, Result};
use crate::retry::{Retry, retry_transient};

/// How long one ReadTokens request is repeated while the allocator is away
/// or leads nobody (a store outage, a takeover).
pub const READ_TOKENS_WAIT: Duration = Duration::from_secs(30);

/// A read grant: the token, and where the extent is now.
#[derive(Clone, Debug)]
pub struct Grant {
    pub token: Vec<u8>,
    pub location: Extent,
}

/// Read grants for committed extents, by `(vdev, offset)` (empty tokens
/// when the allocator signs none). Asked in chunks of 1024 extents.
pub async fn read_grants(
    alloc: &Allocator,
    extents: impl IntoIterator<Item = Extent>,
) -> Result<HashMap<(u32, u64), Grant>> {
    let extents: Vec<_> = extents.into_iter().collect();
    let mut out = HashMap::with_capacity(extents.len());
    let policy = Retry::within(READ_TOKENS_WAIT);
    for chunk in extents.chunks(1024) {
        let r = retry_transient(&policy, || {
            let mut c = alloc.clone();
            let req = ReadTokensRequest {
                extents: chunk.to_vec(),
            };
            async move { c.read_tokens(req).await }
        })
        .await
        .map_err(|s| Error::status("read tokens", s))?
        .into_inner();
        for (i, e) in chunk.iter().enumerate() {
            out.insert(
                (e.vdev, e.offset),
                Grant {
                    token: r.tokens.get(i).cloned().unwrap_or_default(),
                    location: r.locations.get(i).copied().unwrap_or(*e),
                },
            );
        }
    }
    Ok(out)
}

/// Read tokens for committed extents, by `(vdev, offset)`.
pub async fn read_tokens(
    alloc: &Allocator,
    extents: impl IntoIterator<Item = Extent>,
) -> Result<HashMap<(u32, u64), Vec<u8>>> {
    Ok(read_grants(alloc, extents)
        .await?
        .into_iter()
        .map(|(k, g)| (k, g.token))
        .collect())
}

/// Read the extent `e` from the agent at `ep` with `token` (asked for
/// again, once, if the agent restarted since it was granted).
pub async fn read_extent(
    alloc: &Allocator,
    agents: &Agents,
    ep: &str,
    e: Extent,
    mut token: Vec<u8>,
    deadline: Duration,
) -> Result<Bytes> {
    let what = || format!("read vdev {} at {}", e.vdev, e.offset);
    let mut c = agents.get(ep).await?;
    let mut asked_again = false;
    let data = loop {
        let r = tokio::time::timeout(
            deadline,
            c.read(ReadRequest {
                offset: e.offset,
                size: e.size,
                token: token.clone(),
            }),
        )
        .await
        .map_err(|_| Error::Timeout(what(), deadline))?;
        // An agent that restarted since the token was granted refuses it
        // (it cannot know what was written meanwhile): ask again.
        match r {
            Err(s)
                if !asked_again && reason(&s) == Some(ErrorReason::ReadTokenBeforeAgentStart) =>
            {
                asked_again = true;
                token = read_tokens(alloc, [e])
                    .await?
                    .remove(&(e.vdev, e.offset))
                    .unwrap_or_default();
            }
            r => break r.map_err(|s| Error::status(what(), s))?.into_inner().data,
        }
    };
    if data.len() as u64 != e.size {
        return Err(Error::Corrupt(format!(
            "{}: read {} bytes, expected {}",
            what(),
            data.len(),
            e.size
        )));
    }
    Ok(data)
}

/// The agent endpoint of every vdev, as the pool lists them.
pub async fn endpoints(alloc: &Allocator) -> Result<HashMap<u32, String>> {
    let st = retry_transient(&Retry::within(READ_TOKENS_WAIT), || {
        let mut c = alloc.clone();
        async move { c.get_pool(GetPoolRequest {}).await }
    })
    .await
    .map_err(|s| Error::status("get pool", s))?
    .into_inner();
    Ok(st.vdevs.into_iter().map(|v| (v.vdev, v.endpoint)).collect())
}
