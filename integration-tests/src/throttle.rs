//! The throttle as tests watch it: a class's state (RESERVED, its limit,
//! who waits) read from the allocator with GetPool, and the paced
//! `aliquotctl write` that runs beside a batch and says how long it waited
//! in the throttle. The batch tests of each client sample these one way.

use std::process::{Child, Command, Output, Stdio};

use aliquot_proto::v1 as pb;
use pb::allocator_client::AllocatorClient;
use tonic::transport::Channel;

use crate::{FilePool, args, bin, json_u64, lazy_channel};

/// A plaintext allocator's classes, on one connection (cheap to sample
/// often while a batch runs).
#[derive(Clone)]
pub struct Classes(AllocatorClient<Channel>);

impl Classes {
    /// Inside a runtime (the channel's connection task is spawned on it).
    pub fn new(url: &str) -> Classes {
        Classes(AllocatorClient::new(lazy_channel(url)))
    }

    /// The class `name` now (e.g. "normal").
    pub async fn get(&mut self, name: &str) -> pb::ClassStatus {
        let st = self
            .0
            .get_pool(pb::GetPoolRequest {})
            .await
            .expect("GetPool")
            .into_inner();
        st.classes
            .into_iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no class {name:?}"))
    }

    /// The "normal" class now.
    pub async fn normal(&mut self) -> pb::ClassStatus {
        self.get("normal").await
    }

    /// The "normal" class's RESERVED bytes now.
    pub async fn reserved(&mut self) -> u64 {
        self.normal().await.reserved
    }
}

/// The writer beside a batch: `aliquotctl write` of 40 MiB paced at
/// 20 MiB/s (one block per Commit, 2 s of work) to `p`, its JSON report on
/// stdout; see [`throttle_wait_us`].
pub fn paced_writer(p: &FilePool) -> Child {
    Command::new(bin("aliquotctl"))
        .args(args![
            "write",
            "--total",
            "40MiB",
            "--rate",
            "20MiB/s",
            "--no-manifest",
            "--no-progress",
            "--json",
            "--allocator",
            p.url,
            "--insecure",
            "--certs-dir",
            p.data_dir().join("certs").display()
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run aliquotctl write")
}

/// The paced writer's longest wait in the throttle, in µs, and its report;
/// it must have succeeded (`what` names the run in the failure).
pub fn throttle_wait_us(o: &Output, what: &str) -> (u64, serde_json::Value) {
    assert!(
        o.status.success(),
        "aliquotctl write beside {what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let w: serde_json::Value = serde_json::from_slice(&o.stdout).expect("write's JSON report");
    let waited = json_u64(&w["throttle_wait"]["max_us"]).expect("throttle_wait.max_us");
    (waited, w)
}
