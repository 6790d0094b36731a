//! `aliquotctl allocator`: who serves the pool, and a graceful handover.
//! `status` asks each allocator given (`--allocator a,b`) and shows which
//! leads, with its generation, lease and the standbys it sees; `step-down`
//! asks the leader to sync a last txg and hand the pool to a standby at
//! once (a rolling upgrade restarts the standbys first, then steps the
//! leader down and restarts it).

use std::time::{Duration, Instant};

use aliquot_proto::v1::{GetPoolRequest, StepDownRequest};

use crate::client::{self, AllocatorArgs};

#[derive(Clone, Debug, clap::Args)]
pub struct AllocatorCmdArgs {
    #[command(flatten)]
    pub conn: AllocatorArgs,
    #[command(subcommand)]
    pub cmd: AllocatorCmd,
}

#[derive(Clone, Debug, clap::Subcommand)]
pub enum AllocatorCmd {
    /// Which allocator leads, its generation and lease, and the standbys.
    Status,
    /// Hand the leadership to a standby now (the leader syncs a last txg,
    /// clears its lease and stands by); waits until another allocator leads.
    StepDown {
        /// How long to wait for a standby to lead.
        #[arg(long, value_parser = units::duration_arg, default_value = "10s")]
        wait: Duration,
    },
}

pub async fn run(args: AllocatorCmdArgs) -> anyhow::Result<()> {
    let mut c = args.conn.connect().await?;
    match args.cmd {
        AllocatorCmd::Status => {
            // A standby answers NOT_LEADER (retryable at once) and the
            // channel moves to the leader: ask again.
            let st = aliquot_client::retry_transient(
                &aliquot_client::Retry::within(args.conn.leader_wait),
                || {
                    let mut c = c.clone();
                    async move { c.get_pool(GetPoolRequest {}).await }
                },
            )
            .await
            .map_err(|s| client::status_msg("get pool", &s))?
            .into_inner();
            let l = st.leadership.unwrap_or_default();
            println!("pool        {} (guid {:#x})", st.name, st.guid);
            println!("store       {}", l.store);
            if l.store == "postgres" {
                println!("leader      {} (generation {})", l.leader, st.generation);
                println!(
                    "lease       {:.1} s left of {:.1} s",
                    l.lease_left_ms as f64 / 1000.0,
                    l.lease_ms as f64 / 1000.0
                );
                if l.standbys.is_empty() {
                    println!(
                        "standbys    none seen: a takeover needs another allocator on the store"
                    );
                } else {
                    println!("standbys    {}", l.standbys.join(", "));
                }
            } else {
                println!(
                    "leader      this allocator alone (generation {})",
                    st.generation
                );
            }
            Ok(())
        }
        AllocatorCmd::StepDown { wait } => {
            let r = c
                .step_down(StepDownRequest {})
                .await
                .map_err(|s| client::status_msg("step down", &s))?
                .into_inner();
            eprintln!(
                "generation {} is stepping down; standbys: {}",
                r.generation,
                if r.standbys.is_empty() {
                    "none seen (it will lead again in a second)".to_string()
                } else {
                    r.standbys.join(", ")
                }
            );
            // Wait until some allocator leads in a newer generation.
            let t0 = Instant::now();
            loop {
                if let Ok(st) = c.get_pool(GetPoolRequest {}).await {
                    let st = st.into_inner();
                    if st.generation > r.generation {
                        let l = st.leadership.unwrap_or_default();
                        println!(
                            "{} leads in generation {} ({:.2} s after the step-down)",
                            l.leader,
                            st.generation,
                            t0.elapsed().as_secs_f64()
                        );
                        return Ok(());
                    }
                }
                if t0.elapsed() > wait {
                    anyhow::bail!(
                        "no allocator leads in a generation after {} within {wait:?}",
                        r.generation
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
