//! What ztest does, across real processes: a writer allocates, writes a
//! unique pattern per extent to file agents, commits (with `wait_synced` and
//! without), frees; the allocator is `kill -9`ed at random instants (and an
//! agent, and both). After each crash, with the allocator still dead, its
//! SQLite store is read as `aliquotctl verify` reads it: every extent whose
//! commit was acknowledged as synced is allocated in it, exactly; no
//! uncommitted allocation is; the store passes the consistency check (and
//! the `aliquotctl verify` binary agrees). After the restart the writer
//! re-asserts what it committed without knowing it synced with `Claim`
//! (which must succeed), every durable extent still holds its own pattern
//! (read back from the agents), and no allocation ever overlaps an extent
//! the writer still holds.
//!
//! Agents are also hung (SIGSTOP, then SIGCONT): the writer gives each agent
//! write a deadline and leaves a timed-out allocation to its lease, never
//! aborting it (the late write may still land on it when the agent wakes),
//! and nothing else may be placed on it meanwhile.
//!
//! With `secure`, the pool runs as `up` deploys it: mutual TLS,
//! write and read tokens, extents owned by the client that committed them.
//! Between the writer's steps three more actors attack: a second client
//! (`mallory`) tries to free, read and claim the writer's durable blocks
//! (refused: NOT_OWNER, CLAIM_CONFLICT); an admin moves durable blocks to
//! other vdevs as the balancer's mover does (Relocate, write, Commit; a
//! crash in the middle leaves exactly one of the two copies allocated);
//! and old write tokens are replayed: of freed blocks, of blocks moved
//! away, and of the writer's own committed blocks. A replay is refused, or
//! lands on space nobody holds: never on a block the writer holds.
//!
//! On PostgreSQL (two allocators, each reaching the store through a TCP
//! proxy of its own), each allocator kill is a takeover, the leader is also
//! stopped (SIGSTOP), and its path to PostgreSQL is paused in the middle of
//! a transaction for three leases: the standby takes over meanwhile, and the
//! old leader, its path back, persists nothing and answers NOT_LEADER.
//!
//! In the removal runs a fourth vdev is removed (RemoveVdev): the allocator's
//! mover copies its blocks agent to agent while the leader, that vdev's
//! agent and the agents receiving its blocks are killed (on PostgreSQL, the
//! leader taken over). The model learns each move from the store's mapping
//! entries and from ReadTokens: an entry's old extent stays allocated
//! behind it, its new one is allocated on another vdev over nobody's block,
//! and nothing else is allocated (one live copy per block). At the end,
//! that agent dead and its file deleted, every durable block reads back,
//! byte for byte, through its original address.
//!
//! The seed is printed; `ALIQUOT_CRASH_SEED=<n>` replays a run's choices;
//! `ALIQUOT_CRASH_SCALE=<n>` multiplies the PostgreSQL run's faults (a long
//! run: its figures are printed at the end).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aliquot_allocator::recovery;
use aliquot_allocator::sqlite_store;
use aliquot_auth::{PoolCa, Role, TlsFiles};
use aliquot_client::{Retry, retry_transient};
use aliquot_proto::v1 as pb;
use integration_tests::pg_proxy::PgProxy;
use integration_tests::pool::file_device;
use integration_tests::{
    Proc, Security, args, bin, data_request as data_req, lazy_channel as lazy, signal, start_agent,
    tls_args,
};
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_types::StatusExt;

const AGENTS: usize = 3;
/// The writer's deadline on each agent write (`aliquotctl write --timeout`).
const WRITE_DEADLINE: Duration = Duration::from_secs(1);
/// After an agent or allocator comes back, how long before tokens are
/// replayed: revocations reach agents in their next report (200 ms here),
/// and a replay inside that interval is the fence's documented gap.
const SETTLE: Duration = Duration::from_millis(800);

/// A channel to `url`: plaintext, or mutual TLS as `name` (`role`) when the
/// run has certificates.
fn channel(certs: Option<&Path>, url: &str, role: Role, name: &str, server: Role) -> Channel {
    let Some(dir) = certs else {
        return lazy(url);
    };
    let f = TlsFiles::in_dir(dir, role, name);
    Channel::from_shared(url.to_string())
        .expect("a URL")
        .tls_config(f.client_config(server).expect("client TLS"))
        .expect("TLS config")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect_lazy()
}

/// A process's gRPC URL, https when the run is secure.
fn url_of(secure: bool, p: &Proc) -> String {
    if secure {
        format!("https://127.0.0.1:{}", p.addr("grpc").port())
    } else {
        p.url("grpc")
    }
}

/// The port of an endpoint URL.
fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap_or(0)
}

fn reason(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

/// xorshift64*: deterministic choices from a printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// The bytes extent `id` must hold: a header naming it, then a stream.
fn pattern(id: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(b"ALQTCRSH");
    v.extend_from_slice(&id.to_le_bytes());
    while v.len() < len {
        v.extend_from_slice(&r.next().to_le_bytes());
    }
    v.truncate(len);
    v
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    /// Allocated, commit not sent: must be free after a crash.
    Inflight,
    /// Commit sent, no reply yet.
    CommitSent,
    /// Commit acknowledged in this txg, not known to be synced.
    Committed(u64),
    /// Commit acknowledged as synced: must survive every crash.
    Durable,
    /// Free sent, not known to be durable.
    Freeing,
}

#[derive(Clone, Debug)]
struct Block {
    alloc_id: u64,
    extents: Vec<pb::Extent>,
    /// Pattern id of each extent.
    ids: Vec<u64>,
    /// The write token each extent was written with (empty: no tokens).
    tokens: Vec<Vec<u8>>,
    st: St,
    /// When its commit was acknowledged.
    committed_at: Option<Instant>,
    /// A move of one of its copies under way (secure runs).
    moving: Option<Moving>,
}

/// An admin's Relocate of copy `copy` of a durable block to `to`: until
/// its Commit is known to be synced, either copy may be the allocated one
/// after a crash (never both, never neither).
#[derive(Clone, Debug)]
struct Moving {
    copy: usize,
    to: pb::Extent,
    token: Vec<u8>,
}

/// A write token whose extent the writer no longer holds through it (the
/// block was freed, or moved away): replaying it must hurt nobody.
#[derive(Clone, Debug)]
struct Stale {
    extent: pb::Extent,
    token: Vec<u8>,
}

#[derive(Default)]
struct Model {
    blocks: BTreeMap<u64, Block>,
    /// Every extent the writer holds, by (vdev, offset) → (end, block).
    index: BTreeMap<(u32, u64), (u64, u64)>,
    known_synced: u64,
    next_id: u64,
    // Figures for the report.
    allocations: u64,
    durable_acks: u64,
    frees: u64,
    claims: u64,
    aborts: u64,
    verified_extents: u64,
    lost_uncommitted: u64,
    dup_commits: u64,
    /// Inflight blocks whose agent write timed out: left to their lease.
    abandoned: HashSet<u64>,
    write_timeouts: u64,
    // Secure runs.
    stale: Vec<Stale>,
    foreign_refused: BTreeMap<String, u64>,
    replays_refused: BTreeMap<String, u64>,
    replays_on_free_space: u64,
    moves: u64,
    moves_resolved_by_crash: u64,
    /// Blocks the allocator's mover moved off a removed vdev, keeping
    /// their address: old (vdev, offset) -> new extent. The new extent is
    /// in `index` too (held by the same block), so nothing else may land on
    /// it.
    moved: BTreeMap<(u32, u64), pb::Extent>,
    /// The most mapping entries one check of the store saw, and the moved
    /// blocks read back through their old address.
    store_mappings: usize,
    read_through_mapping: u64,
    /// Blocks of two copies whose moved copy joined the other's vdev.
    copies_joined: u64,
}

impl Model {
    fn insert(&mut self, b: Block) -> u64 {
        let key = self.next_id;
        self.next_id += 1;
        for e in &b.extents {
            self.check_free(e);
        }
        for e in &b.extents {
            self.index
                .insert((e.vdev, e.offset), (e.offset + e.size, key));
        }
        self.blocks.insert(key, b);
        key
    }

    /// Panics if the writer already holds any byte of `e`.
    fn check_free(&self, e: &pb::Extent) {
        {
            let end = e.offset + e.size;
            // The extent at or before our offset, and any starting inside.
            if let Some((&(v, off), &(pend, other))) =
                self.index.range(..=(e.vdev, e.offset)).next_back()
                && v == e.vdev
                && pend > e.offset
            {
                panic!(
                    "extent {}:{:#x}+{:#x} handed out twice: block {other} holds {v}:{off:#x}..{pend:#x}",
                    e.vdev, e.offset, e.size
                );
            }
            if let Some((&(v, off), &(_, other))) =
                self.index.range((e.vdev, e.offset)..(e.vdev, end)).next()
            {
                panic!(
                    "extent {}:{:#x}+{:#x} handed out twice: block {other} holds {v}:{off:#x}",
                    e.vdev, e.offset, e.size
                );
            }
        }
    }

    /// The blocks holding any byte of `e`.
    fn holders(&self, e: &pb::Extent) -> Vec<u64> {
        let mut out = Vec::new();
        if let Some((&(v, _), &(end, key))) = self.index.range(..=(e.vdev, e.offset)).next_back()
            && v == e.vdev
            && end > e.offset
        {
            out.push(key);
        }
        for (_, &(_, key)) in self
            .index
            .range((e.vdev, e.offset + 1)..(e.vdev, e.offset + e.size))
        {
            out.push(key);
        }
        out
    }

    /// A move of copy `copy` of block `key` is over: `to` became the copy
    /// (`moved`) or was never allocated.
    fn finish_move(&mut self, key: u64, moved: bool) {
        let Some(b) = self.blocks.get_mut(&key) else {
            return;
        };
        let Some(mv) = b.moving.take() else {
            return;
        };
        if moved {
            let old = std::mem::replace(&mut b.extents[mv.copy], mv.to);
            let old_token = std::mem::replace(&mut b.tokens[mv.copy], mv.token);
            self.index.remove(&(old.vdev, old.offset));
            self.stale.push(Stale {
                extent: old,
                token: old_token,
            });
            self.moves += 1;
        } else {
            self.index.remove(&(mv.to.vdev, mv.to.offset));
        }
    }

    /// The mover moved `from` (an extent the writer holds) to `to`, as the
    /// store's mapping entry or ReadTokens says: `to` must be space nobody
    /// else holds (a block whose free may have synced aside).
    fn learn_move(&mut self, from: &pb::Extent, to: &pb::Extent) {
        let Some(&(_, key)) = self.index.get(&(from.vdev, from.offset)) else {
            panic!("a mapping entry for {from:?}, which the writer does not hold");
        };
        assert_eq!(from.size, to.size, "{from:?} moved to {to:?}");
        if self.moved.get(&(from.vdev, from.offset)) == Some(to) {
            return;
        }
        assert!(
            !self.moved.contains_key(&(from.vdev, from.offset)),
            "{from:?} moved again, to {to:?} (was {:?})",
            self.moved[&(from.vdev, from.offset)]
        );
        let others: Vec<u64> = self
            .holders(to)
            .into_iter()
            .filter(|k| *k != key && self.blocks[k].st != St::Freeing)
            .collect();
        assert!(
            others.is_empty(),
            "block {key} moved from {from:?} onto {to:?}, held by blocks {others:?}"
        );
        // A move that must happen keeps off the other copies' vdevs only
        // while another vdev can take it (`Pool::removal_avoid`): with an
        // agent down, or not yet reported after a restart, the copy may
        // join its other copy. Counted, not refused (vdev_removal.rs checks
        // the fault-free case).
        if self.blocks[&key]
            .extents
            .iter()
            .any(|e| e != from && e.vdev == to.vdev)
        {
            self.copies_joined += 1;
        }
        self.index
            .insert((to.vdev, to.offset), (to.offset + to.size, key));
        self.moved.insert((from.vdev, from.offset), *to);
    }

    fn remove(&mut self, key: u64) {
        if let Some(b) = self.blocks.remove(&key) {
            for e in &b.extents {
                self.index.remove(&(e.vdev, e.offset));
                if let Some(to) = self.moved.remove(&(e.vdev, e.offset)) {
                    self.index.remove(&(to.vdev, to.offset));
                }
            }
            if let Some(mv) = b.moving {
                self.index.remove(&(mv.to.vdev, mv.to.offset));
            }
        }
    }

    fn synced(&mut self, txg: u64) {
        self.known_synced = self.known_synced.max(txg);
        let k = self.known_synced;
        for b in self.blocks.values_mut() {
            if let St::Committed(t) = b.st
                && t <= k
            {
                b.st = St::Durable;
            }
        }
    }

    fn keys(&self, f: impl Fn(St) -> bool) -> Vec<u64> {
        self.blocks
            .iter()
            .filter(|(_, b)| f(b.st))
            .map(|(k, _)| *k)
            .collect()
    }
}

struct Cluster {
    dir: PathBuf,
    alloc: Proc,
    agents: Vec<Proc>,
    alloc_url: String,
    client: AllocatorClient<Channel>,
    agent_clients: HashMap<String, VdevAgentClient<Channel>>,
    /// vdev id → endpoint, as the allocator reported them.
    endpoints: HashMap<u32, String>,
    guids: Vec<(u32, u64)>,
    /// The vdev whose agent is stopped (SIGSTOP) across a restart: it
    /// cannot report in, so a restart does not wait for it.
    asleep: Option<u32>,
    /// The PostgreSQL variant: the store, and the allocator
    /// standing by; a "restart" of the killed leader is a takeover by it.
    pg: Option<integration_tests::postgres::Postgres>,
    standby: Option<Proc>,
    /// When the leader was last killed, and each takeover's time from the
    /// kill to the standby serving with every awake vdev reported in.
    killed_at: Option<Instant>,
    takeovers: Vec<Duration>,
    /// The leader is stopped (SIGSTOP), not killed; and how many woken
    /// leaders answered NOT_LEADER.
    stopped: bool,
    woken_refused: u64,
    /// On PostgreSQL: each allocator's path to the store (`alloc`'s is
    /// `proxies[lead]`), the one paused mid-transaction and since when, and
    /// how many leaders, their path back, answered NOT_LEADER.
    proxies: Vec<PgProxy>,
    lead: usize,
    paused: Option<(usize, Instant)>,
    unpaused_refused: u64,
    /// Secure runs: the CA directory, and the other actors.
    certs: Option<PathBuf>,
    admin: Option<AllocatorClient<Channel>>,
    mallory: Option<AllocatorClient<Channel>>,
    /// The vdev whose agent is stopped or dead for a while (no attacks
    /// meanwhile), and when agents will have heard every revocation.
    away: Option<u32>,
    settled_at: Instant,
    /// The vdev being removed (RemoveVdev) and its agent: its blocks move
    /// to the other vdevs while the faults hit.
    removing: Option<(u32, usize)>,
}

impl Cluster {
    /// With `ha`, two allocators on a private PostgreSQL server; with
    /// `secure`, mutual TLS and tokens.
    async fn start_with(dir: &Path, ha: bool, secure: bool, n_agents: usize) -> Cluster {
        let certs = secure.then(|| {
            let d = dir.join("certs");
            let ca = PoolCa::init(&d, "crash").expect("CA");
            ca.issue(Role::Allocator, "allocator", &[]).unwrap();
            for i in 0..n_agents {
                ca.issue(Role::Agent, &format!("v{i}"), &[]).unwrap();
            }
            ca.issue(Role::Client, "writer", &[]).unwrap();
            ca.issue(Role::Client, "mallory", &[]).unwrap();
            ca.issue(Role::Admin, "op", &[]).unwrap();
            d
        });
        let writer = |url: &str, server: Role| {
            channel(certs.as_deref(), url, Role::Client, "writer", server)
        };
        let mut alloc_args = args![
            "--listen",
            "127.0.0.1:0",
            "--pool",
            "crash",
            "--data-dir",
            dir.join("allocator").display(),
            "--zfs-txg-timeout",
            "100ms",
            "--lease",
            "120s",
            "--report-interval",
            "200ms",
            // After each restart Allocate waits this long while the writer
            // claims what it committed without knowing it synced.
            "--claim-window",
            "300ms",
        ];
        if let Some(d) = &certs {
            alloc_args.extend(tls_args(d, Role::Allocator, "allocator"));
            alloc_args.extend(args!["--token-key", d.display()]);
            for i in 0..n_agents {
                alloc_args.extend(args!["--admit-agent", format!("v{i}")]);
            }
        }
        let pg = ha.then(integration_tests::postgres::Postgres::start);
        let mut proxies = Vec::new();
        if let Some(pg) = &pg {
            alloc_args.extend(args!["--leader-lease", "1s"]);
            for _ in 0..2 {
                proxies.push(PgProxy::start(pg.port).await);
            }
        }
        let store_args = |i: usize| -> Vec<String> {
            let mut a = alloc_args.clone();
            if let Some(p) = proxies.get(i) {
                a.extend(args!["--store", p.url()]);
            }
            a
        };
        let mut alloc = Proc::start(
            "allocator",
            &bin("aliquot-allocator"),
            &store_args(0),
            &[],
            &["grpc"],
            dir,
        )
        .expect("start allocator");
        let mut standby = None;
        if ha {
            let mut b = Proc::start(
                "allocator-b",
                &bin("aliquot-allocator"),
                &store_args(1),
                &[],
                &["grpc"],
                dir,
            )
            .expect("start allocator b");
            let addr = b.addr("grpc");
            b.set_arg("--listen", &addr.to_string());
            standby = Some(b);
        }
        // Restarts come back on the same port, where the agents look.
        let addr = alloc.addr("grpc");
        alloc.set_arg("--listen", &addr.to_string());
        let mut alloc_url = url_of(secure, &alloc);
        let allocators = match &standby {
            Some(b) => format!("{alloc_url},{}", url_of(secure, b)),
            None => alloc_url.clone(),
        };
        let mut agents = Vec::new();
        for i in 0..n_agents {
            let name = format!("v{i}");
            let security = certs.as_deref().map_or(Security::Plaintext, Security::Tls);
            let device = file_device(&dir.join(format!("{name}.img")), "256MiB");
            agents.push(start_agent(dir, security, &allocators, &name, &device, &[]));
        }
        // Whichever leads is `alloc`.
        let mut lead = 0;
        if let Some(b) = standby.as_mut() {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let mut ca = AllocatorClient::new(writer(&alloc_url, Role::Allocator));
                if ca.get_pool(pb::GetPoolRequest {}).await.is_ok() {
                    break;
                }
                let mut cb = AllocatorClient::new(writer(&url_of(secure, b), Role::Allocator));
                if cb.get_pool(pb::GetPoolRequest {}).await.is_ok() {
                    std::mem::swap(&mut alloc, b);
                    alloc_url = url_of(secure, &alloc);
                    lead = 1;
                    break;
                }
                assert!(Instant::now() < deadline, "no allocator leads");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let client = AllocatorClient::new(writer(&alloc_url, Role::Allocator));
        let mut c = Cluster {
            dir: dir.to_path_buf(),
            alloc,
            agents,
            alloc_url,
            client,
            agent_clients: HashMap::new(),
            endpoints: HashMap::new(),
            guids: Vec::new(),
            asleep: None,
            pg,
            standby,
            killed_at: None,
            takeovers: Vec::new(),
            stopped: false,
            woken_refused: 0,
            proxies,
            lead,
            paused: None,
            unpaused_refused: 0,
            certs,
            admin: None,
            mallory: None,
            away: None,
            settled_at: Instant::now(),
            removing: None,
        };
        c.connect_actors();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut joined_by = None;
        loop {
            let s = c.pool().await;
            // A vdev shows in GetPool as soon as it joins the open txg, and
            // is the pool's only once that txg syncs (its agent's Register
            // returns then); a takeover before that rightly forgets it.
            if s.vdevs.len() == n_agents && joined_by.is_none() {
                joined_by = Some(s.open_txg);
            }
            if joined_by.is_some_and(|t| s.synced_txg >= t) {
                c.guids = s.vdevs.iter().map(|v| (v.vdev, v.guid)).collect();
                c.endpoints = s
                    .vdevs
                    .iter()
                    .map(|v| (v.vdev, v.endpoint.clone()))
                    .collect();
                break;
            }
            assert!(Instant::now() < deadline, "agents did not register");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        c
    }

    fn secure(&self) -> bool {
        self.certs.is_some()
    }

    /// The writer's, the admin's and mallory's allocator clients, to the
    /// allocator that leads now.
    fn connect_actors(&mut self) {
        let certs = self.certs.as_deref();
        let ch = |role, name| channel(certs, &self.alloc_url, role, name, Role::Allocator);
        self.client = AllocatorClient::new(ch(Role::Client, "writer"));
        if self.certs.is_some() {
            self.admin = Some(AllocatorClient::new(ch(Role::Admin, "op")));
            self.mallory = Some(AllocatorClient::new(ch(Role::Client, "mallory")));
        }
    }

    /// Something came back: let revocations and generations reach the
    /// agents before tokens are replayed.
    fn unsettle(&mut self) {
        self.settled_at = Instant::now() + SETTLE;
    }

    fn db(&self) -> PathBuf {
        self.dir.join("allocator").join(sqlite_store::DB_FILE)
    }

    async fn pool(&mut self) -> pb::PoolStatus {
        // A leader whose lease lapsed for a moment (a renewal late on a
        // loaded machine) answers NOT_LEADER until it renews.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match self.client.get_pool(pb::GetPoolRequest {}).await {
                Ok(r) => return r.into_inner(),
                Err(e) if e.code() == Code::Unavailable && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("get pool: {e}"),
            }
        }
    }

    fn agent(&mut self, endpoint: &str) -> VdevAgentClient<Channel> {
        self.agent_clients
            .entry(endpoint.to_string())
            .or_insert_with(|| {
                VdevAgentClient::new(channel(
                    self.certs.as_deref(),
                    endpoint,
                    Role::Client,
                    "writer",
                    Role::Agent,
                ))
            })
            .clone()
    }

    fn agent_of_vdev(&self, vdev: u32) -> usize {
        let port = port_of(&self.endpoints[&vdev]);
        self.agents
            .iter()
            .position(|a| a.addr("grpc").port() == port)
            .expect("agent of vdev")
    }

    fn kill_allocator(&mut self) {
        self.alloc.kill9();
        self.killed_at = Some(Instant::now());
    }

    /// SIGSTOP the leader (PostgreSQL): the standby takes over while it is
    /// stopped; `restart_allocator_on_any_store` wakes it.
    fn stop_allocator(&mut self) {
        signal(&self.alloc, "-STOP");
        self.stopped = true;
        self.killed_at = Some(Instant::now());
    }

    /// Pause the leader's path to PostgreSQL at its next transaction, once
    /// it began (within 10 s: txgs sync every 100 ms).
    fn arm_pause(&mut self) {
        self.proxies[self.lead].arm();
    }

    async fn wait_paused(&mut self) {
        self.proxies[self.lead]
            .wait_frozen(Duration::from_secs(10))
            .await;
        let now = Instant::now();
        self.paused = Some((self.lead, now));
        self.killed_at = Some(now);
    }

    /// The old leader (`b`), woken or its path back, serves nothing.
    async fn wait_not_leader(&self, b: &Proc) {
        let old = url_of(self.certs.is_some(), b);
        let mut co = AllocatorClient::new(channel(
            self.certs.as_deref(),
            &old,
            Role::Client,
            "writer",
            Role::Allocator,
        ));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match co.allocate(data_req(64 << 10)).await {
                Ok(r) => panic!("the old leader allocated {:?}", r.into_inner().extents),
                Err(e) if e.message().contains("does not lead") => break,
                Err(e) => {
                    assert!(Instant::now() < deadline, "never NOT_LEADER: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn restart_allocator(&mut self) {
        self.restart_allocator_on_any_store().await;
        self.wait_vdevs_reported().await;
        self.unsettle();
        if let (true, Some(t)) = (self.standby.is_some(), self.killed_at.take()) {
            self.takeovers.push(t.elapsed());
        }
    }

    /// Restarts the allocator without waiting for the agents to report in
    /// (on an older store they never will: it is refused).
    async fn restart_allocator_on_any_store(&mut self) {
        if let Some(b) = self.standby.as_mut() {
            // The killed leader's standby takes over within the lease; the
            // killed one comes back as the standby.
            let deadline = Instant::now() + Duration::from_secs(20);
            let url = url_of(self.certs.is_some(), b);
            loop {
                let mut cb = AllocatorClient::new(channel(
                    self.certs.as_deref(),
                    &url,
                    Role::Client,
                    "writer",
                    Role::Allocator,
                ));
                if cb.get_pool(pb::GetPoolRequest {}).await.is_ok() {
                    break;
                }
                assert!(Instant::now() < deadline, "the standby never took over");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            std::mem::swap(&mut self.alloc, b);
            self.lead = 1 - self.lead;
            if std::mem::take(&mut self.stopped) {
                // Woken after the takeover: it serves nothing.
                signal(b, "-CONT");
                let b = self.standby.as_ref().expect("standby");
                self.wait_not_leader(b).await;
                self.woken_refused += 1;
            }
            if let Some((i, since)) = self.paused.take() {
                // The path stays paused for three leases (1 s each), then
                // the old leader hears its answers: it serves nothing.
                tokio::time::sleep((3 * Duration::from_secs(1)).saturating_sub(since.elapsed()))
                    .await;
                self.proxies[i].thaw();
                let b = self.standby.as_ref().expect("standby");
                self.wait_not_leader(b).await;
                self.unpaused_refused += 1;
            }
            let b = self.standby.as_mut().expect("standby");
            b.restart().expect("restart the old leader as a standby");
            self.alloc_url = url;
        } else {
            self.alloc.restart().expect("restart allocator");
        }
        self.connect_actors();
        // Same pool, same vdevs, same ids.
        let s = self.pool().await;
        let guids: Vec<(u32, u64)> = s.vdevs.iter().map(|v| (v.vdev, v.guid)).collect();
        // A removed vdev leaves the pool once its last moved block is freed.
        let kept: Vec<(u32, u64)> = self
            .guids
            .iter()
            .filter(|g| guids.contains(g) || Some(g.0) != self.removing.map(|r| r.0))
            .copied()
            .collect();
        assert_eq!(guids, kept, "vdevs recovered with their ids");
    }

    async fn wait_vdevs_reported(&mut self) {
        // Recovered vdevs stay unavailable until their agents report in
        // the new generation; a client would wait (as `aliquotctl write
        // --allocator-wait` does), and so does the test.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = self.pool().await;
            let waiting: Vec<u32> = s
                .vdevs
                .iter()
                .filter(|v| Some(v.vdev) != self.asleep)
                .filter(|v| v.health == pb::VdevHealth::Unavailable as i32)
                .map(|v| v.vdev)
                .collect();
            if waiting.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "vdevs {waiting:?} never reported in after the restart"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Outcome of one writer step when the allocator is alive.
type StepResult = Result<(), String>;

async fn step(c: &mut Cluster, m: &mut Model, rng: &mut Rng) -> StepResult {
    if c.secure() && c.away.is_none() && c.asleep.is_none() {
        if rng.chance(4) {
            return foreign_attempt(c, m, rng).await;
        }
        if rng.chance(6) {
            return replay(c, m, rng).await;
        }
        if rng.chance(3) {
            return relocate(c, m, rng).await;
        }
    }
    let durable: Vec<u64> = m
        .keys(|s| s == St::Durable)
        .into_iter()
        .filter(|k| m.blocks[k].moving.is_none())
        .collect();
    if durable.len() > 120 && rng.chance(30) {
        // Free a durable block and wait for the free to be durable.
        let key = durable[rng.below(durable.len() as u64) as usize];
        m.blocks.get_mut(&key).unwrap().st = St::Freeing;
        let extents = m.blocks[&key].extents.clone();
        let f = free_after_moves(&mut c.client, extents)
            .await
            .map_err(|e| format!("free: {e}"))?;
        let s = c
            .client
            .sync_txg(pb::SyncTxgRequest {
                txg: f.txg,
                generation: f.generation,
            })
            .await
            .map_err(|e| format!("sync: {e}"))?
            .into_inner()
            .synced_txg;
        if let Some(b) = m.blocks.get(&key)
            && c.secure()
        {
            for (e, t) in b.extents.iter().zip(&b.tokens) {
                m.stale.push(Stale {
                    extent: *e,
                    token: t.clone(),
                });
            }
        }
        m.remove(key);
        m.synced(s);
        m.frees += 1;
        return Ok(());
    }
    if rng.chance(5) {
        let s = c
            .client
            .sync_txg(pb::SyncTxgRequest {
                txg: 0,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("sync: {e}"))?
            .into_inner()
            .synced_txg;
        m.synced(s);
    }
    let log = rng.chance(10);
    let req = pb::AllocateRequest {
        class: if log {
            pb::AllocationClass::Log
        } else {
            pb::AllocationClass::Data
        } as i32,
        size: 4096 * (1 + rng.below(16)),
        copies: if rng.chance(30) { 2 } else { 1 },
        lease_ms: 0,
        max_size: 0,
        affinity_key: None,
    };
    let a = match c.client.allocate(req).await {
        Ok(r) => r.into_inner(),
        Err(e) if e.code() == Code::ResourceExhausted => return Ok(()),
        Err(e) => return Err(format!("allocate: {e}")),
    };
    m.allocations += 1;
    let ids: Vec<u64> = a
        .extents
        .iter()
        .map(|_| {
            m.next_id += 1;
            m.next_id
        })
        .collect();
    let key = m.insert(Block {
        alloc_id: a.allocation_id,
        extents: a.extents.clone(),
        ids: ids.clone(),
        tokens: (0..a.extents.len())
            .map(|i| a.tokens.get(i).cloned().unwrap_or_default())
            .collect(),
        st: St::Inflight,
        committed_at: None,
        moving: None,
    });
    for (i, e) in a.extents.iter().enumerate() {
        let mut agent = c.agent(&a.endpoints[i]);
        let w = tokio::time::timeout(
            WRITE_DEADLINE,
            agent.write(pb::WriteRequest {
                offset: e.offset,
                data: pattern(ids[i], e.size as usize).into(),
                token: a.tokens.get(i).cloned().unwrap_or_default(),
            }),
        )
        .await;
        let Ok(w) = w else {
            // A hung agent: the write may still land when it wakes, so the
            // allocation is not aborted; it stays held (the model checks
            // nothing else is placed on it) until a crash or its lease.
            m.write_timeouts += 1;
            m.abandoned.insert(key);
            return Ok(());
        };
        if let Err(err) = w {
            // The agent is away: give the allocation back (never written).
            m.aborts += 1;
            if let Err(e) = c
                .client
                .abort(pb::AbortRequest {
                    allocation_ids: vec![a.allocation_id],
                })
                .await
            {
                return Err(format!("abort after write error {err}: {e}"));
            }
            m.remove(key);
            return Ok(());
        }
    }
    if rng.chance(4) {
        // Left uncommitted on purpose: a crash must give its space back.
        return Ok(());
    }
    let wait_synced = rng.chance(65);
    m.blocks.get_mut(&key).unwrap().st = St::CommitSent;
    let r = c
        .client
        .commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced,
            generation: a.generation,
        })
        .await
        .map_err(|e| format!("commit: {e}"))?
        .into_inner();
    if rng.chance(20) {
        // A duplicated commit (a client's retry) answers the first txg.
        let again = c
            .client
            .commit(pb::CommitRequest {
                allocation_ids: vec![a.allocation_id],
                wait_synced: false,
                generation: a.generation,
            })
            .await
            .map_err(|e| format!("repeated commit: {e}"))?
            .into_inner();
        if again.txg != r.txg {
            return Err(format!(
                "repeated commit of {} answered txg {}, the first {}",
                a.allocation_id, again.txg, r.txg
            ));
        }
        m.dup_commits += 1;
    }
    let b = m.blocks.get_mut(&key).unwrap();
    b.committed_at = Some(Instant::now());
    if r.synced {
        b.st = St::Durable;
        m.durable_acks += 1;
        m.synced(r.txg);
    } else {
        b.st = St::Committed(r.txg);
    }
    Ok(())
}

/// Free as a client does while the allocator's mover copies one of the
/// extents (RELOCATION_CONFLICT): wait for that move, then free.
async fn free_after_moves(
    client: &mut AllocatorClient<Channel>,
    extents: Vec<pb::Extent>,
) -> Result<pb::FreeReply, tonic::Status> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = client
            .free(pb::FreeRequest {
                extents: extents.clone(),
            })
            .await;
        match r {
            Err(e) if reason(&e) == "RELOCATION_CONFLICT" && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            r => return r.map(tonic::Response::into_inner),
        }
    }
}

/// A durable block that is not being moved, at random.
fn some_durable(m: &Model, rng: &mut Rng) -> Option<u64> {
    let keys: Vec<u64> = m
        .keys(|s| s == St::Durable)
        .into_iter()
        .filter(|k| m.blocks[k].moving.is_none())
        .collect();
    (!keys.is_empty()).then(|| keys[rng.below(keys.len() as u64) as usize])
}

/// Mallory, another client, goes after one of the writer's durable blocks:
/// Free, ReadTokens and Claim are all refused.
async fn foreign_attempt(c: &mut Cluster, m: &mut Model, rng: &mut Rng) -> StepResult {
    let Some(key) = some_durable(m, rng) else {
        return Ok(());
    };
    let extents = m.blocks[&key].extents.clone();
    let mallory = c.mallory.as_mut().expect("secure run");
    let mut note = |what: &str, r: Result<(), tonic::Status>, want: &[(Code, &str)]| match r {
        Ok(()) => Err(format!(
            "another client's {what} of the writer's durable block {key} ({extents:?}) was accepted"
        )),
        Err(e) if want.iter().any(|(c, r)| e.code() == *c && reason(&e) == *r) => {
            *m.foreign_refused
                .entry(format!("{what} {}", reason(&e)))
                .or_default() += 1;
            Ok(())
        }
        Err(e) => Err(format!(
            "{what} by another client: unexpected refusal {e:?}"
        )),
    };
    let r = mallory
        .free(pb::FreeRequest {
            extents: extents.clone(),
        })
        .await
        .map(|_| ());
    note("free", r, &[(Code::PermissionDenied, "NOT_OWNER")])?;
    let r = mallory
        .read_tokens(pb::ReadTokensRequest {
            extents: extents.clone(),
        })
        .await
        .map(|_| ());
    note("read", r, &[(Code::PermissionDenied, "NOT_OWNER")])?;
    let r = mallory
        .claim(pb::ClaimRequest {
            extents: extents.clone(),
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .map(|_| ());
    note(
        "claim",
        r,
        &[
            (Code::FailedPrecondition, "CLAIM_CONFLICT"),
            (Code::PermissionDenied, "NOT_OWNER"),
        ],
    )
}

/// Replay an old write token with garbage: a freed or moved-away block's
/// (it may land only where nobody holds anything), or the writer's own
/// committed block's (revoked: refused).
async fn replay(c: &mut Cluster, m: &mut Model, rng: &mut Rng) -> StepResult {
    // Own blocks only once every agent has had a report since coming back.
    let own = Instant::now() >= c.settled_at && rng.chance(40);
    let (extent, token, own_key) = if own {
        let old: Vec<u64> = m
            .keys(|s| s == St::Durable)
            .into_iter()
            .filter(|k| {
                m.blocks[k]
                    .committed_at
                    .is_some_and(|t| t + SETTLE < Instant::now())
            })
            .collect();
        if old.is_empty() {
            return Ok(());
        }
        let key = old[rng.below(old.len() as u64) as usize];
        let b = &m.blocks[&key];
        let i = rng.below(b.extents.len() as u64) as usize;
        (b.extents[i], b.tokens[i].clone(), Some(key))
    } else {
        if m.stale.is_empty() {
            return Ok(());
        }
        // Half the time one of the newest: most likely of this generation,
        // so the agent's fence (not the generation) has to refuse it.
        let n = m.stale.len() as u64;
        let i = if rng.chance(50) {
            n - 1 - rng.below(n.min(16))
        } else {
            rng.below(n)
        };
        let s = m.stale[i as usize].clone();
        (s.extent, s.token, None)
    };
    let Some(ep) = c.endpoints.get(&extent.vdev).cloned() else {
        return Ok(());
    };
    let r = tokio::time::timeout(
        WRITE_DEADLINE,
        c.agent(&ep).write(pb::WriteRequest {
            offset: extent.offset,
            data: vec![0xee; extent.size as usize].into(),
            token,
        }),
    )
    .await
    .map_err(|_| format!("replay to {ep} timed out (no agent is away)"))?;
    match r {
        Err(e) if e.code() == Code::PermissionDenied => {
            *m.replays_refused.entry(reason(&e)).or_default() += 1;
            Ok(())
        }
        Err(e) => Err(format!(
            "replay of a token to {ep}: unexpected refusal {e:?}"
        )),
        Ok(_) => {
            if let Some(key) = own_key {
                return Err(format!(
                    "a replayed token of committed block {key} overwrote it ({extent:?}): \
                     its revocation did not reach the agent"
                ));
            }
            let hurt: Vec<u64> = m
                .holders(&extent)
                .into_iter()
                .filter(|k| !m.abandoned.contains(k))
                .collect();
            if !hurt.is_empty() {
                return Err(format!(
                    "a replayed stale token wrote {extent:?} over blocks {hurt:?} the writer holds"
                ));
            }
            m.replays_on_free_space += 1;
            Ok(())
        }
    }
}

/// The mover (an admin): Relocate a durable block's copy, write it there,
/// Commit (which frees the old copy in the same txg) and wait for the sync.
/// A crash anywhere in between leaves exactly one copy allocated.
async fn relocate(c: &mut Cluster, m: &mut Model, rng: &mut Rng) -> StepResult {
    let Some(key) = some_durable(m, rng) else {
        return Ok(());
    };
    let b = m.blocks[&key].clone();
    let copy = rng.below(b.extents.len() as u64) as usize;
    let avoid: Vec<u32> = b
        .extents
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != copy)
        .map(|(_, e)| e.vdev)
        .collect();
    let admin = c.admin.as_mut().expect("secure run");
    let r = match admin
        .relocate(pb::RelocateRequest {
            extent: Some(b.extents[copy]),
            avoid_vdevs: avoid,
            ..Default::default()
        })
        .await
    {
        Ok(r) => r.into_inner(),
        Err(e) if matches!(e.code(), Code::ResourceExhausted | Code::FailedPrecondition) => {
            return Ok(());
        }
        Err(e) => return Err(format!("relocate: {e}")),
    };
    let to = r.extents[0];
    m.check_free(&to);
    m.index
        .insert((to.vdev, to.offset), (to.offset + to.size, key));
    let token = r.tokens.first().cloned().unwrap_or_default();
    m.blocks.get_mut(&key).unwrap().moving = Some(Moving {
        copy,
        to,
        token: token.clone(),
    });
    let w = tokio::time::timeout(
        WRITE_DEADLINE,
        c.agent(&r.endpoints[0]).write(pb::WriteRequest {
            offset: to.offset,
            data: pattern(b.ids[copy], to.size as usize).into(),
            token,
        }),
    )
    .await;
    if !matches!(w, Ok(Ok(_))) {
        // Left to its lease (a late write may still land on it); the block
        // keeps its old copy until a crash resolves the move.
        return Ok(());
    }
    let admin = c.admin.as_mut().expect("secure run");
    let done = admin
        .commit(pb::CommitRequest {
            allocation_ids: vec![r.allocation_id],
            wait_synced: true,
            generation: r.generation,
        })
        .await
        .map_err(|e| format!("commit of a relocation: {e}"))?
        .into_inner();
    let synced = admin
        .sync_txg(pb::SyncTxgRequest {
            txg: done.txg,
            generation: r.generation,
        })
        .await
        .map_err(|e| format!("sync of a relocation: {e}"))?
        .into_inner()
        .synced_txg;
    m.synced(synced);
    m.finish_move(key, true);
    Ok(())
}

/// Write until `deadline` (the allocator stays alive: errors are bugs).
async fn write_until(c: &mut Cluster, m: &mut Model, rng: &mut Rng, deadline: Instant) {
    while Instant::now() < deadline {
        if let Err(e) = step(c, m, rng).await {
            panic!("writer: {e}");
        }
    }
}

/// Write until cancelled (the allocator is killed under it).
async fn write_forever(c: &mut Cluster, m: &mut Model, rng: &mut Rng) {
    loop {
        if let Err(e) = step(c, m, rng).await {
            panic!("writer: {e}");
        }
    }
}

/// With the allocator dead: the store as `aliquotctl verify` reads it.
async fn check_store(c: &mut Cluster, m: &mut Model) {
    let p = match &c.pg {
        Some(pg) => aliquot_allocator::pg_store::read_only(&pg.url(), "crash")
            .await
            .expect("store readable")
            .expect("pool exists"),
        None => {
            sqlite_store::read_only(&c.db())
                .await
                .expect("store readable")
                .expect("pool exists")
                .1
        }
    };
    recovery::verify(&p).unwrap_or_else(|e| panic!("store inconsistent after kill -9: {e}"));
    let exact: HashSet<(u32, u64, u64)> = p
        .allocated
        .iter()
        .map(|e| (e.vdev, e.offset, e.size))
        .collect();
    let mut by_vdev: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    for e in &p.allocated {
        by_vdev.insert((e.vdev, e.offset), e.offset + e.size);
    }
    let overlaps = |e: &pb::Extent| {
        let before = by_vdev
            .range(..=(e.vdev, e.offset))
            .next_back()
            .is_some_and(|(&(v, _), &end)| v == e.vdev && end > e.offset);
        let inside = by_vdev
            .range((e.vdev, e.offset)..(e.vdev, e.offset + e.size))
            .next()
            .is_some();
        before || inside
    };
    let mut moves = Vec::new();
    for key in m.keys(|_| true) {
        let b = m.blocks[&key].clone();
        match b.st {
            St::Durable => {
                let moving = b.moving.as_ref().map(|mv| mv.copy);
                if let Some(mv) = &b.moving {
                    let has = |e: &pb::Extent| exact.contains(&(e.vdev, e.offset, e.size));
                    let (old, new) = (has(&b.extents[mv.copy]), has(&mv.to));
                    assert!(
                        old != new,
                        "a move of block {key}'s copy {:?} to {:?} left {} copies allocated",
                        b.extents[mv.copy],
                        mv.to,
                        if old { "both" } else { "no" }
                    );
                    moves.push((key, new));
                }
                for (i, e) in b.extents.iter().enumerate() {
                    if moving == Some(i) {
                        continue;
                    }
                    assert!(
                        exact.contains(&(e.vdev, e.offset, e.size)),
                        "extent {}:{:#x}+{:#x} was acknowledged as synced but is not in the store (synced txg {})",
                        e.vdev,
                        e.offset,
                        e.size,
                        p.synced_txg
                    );
                }
            }
            St::Inflight => {
                for e in &b.extents {
                    assert!(
                        !overlaps(e),
                        "uncommitted extent {}:{:#x}+{:#x} is allocated in the store",
                        e.vdev,
                        e.offset,
                        e.size
                    );
                }
                m.remove(key);
                m.lost_uncommitted += 1;
            }
            St::Freeing => {
                // Durable free or not: either the exact extent or nothing.
                for e in &b.extents {
                    let present = exact.contains(&(e.vdev, e.offset, e.size));
                    assert!(present || !overlaps(e), "half-freed extent {e:?}");
                }
            }
            St::CommitSent | St::Committed(_) => {
                for e in &b.extents {
                    let present = exact.contains(&(e.vdev, e.offset, e.size));
                    assert!(present || !overlaps(e), "half-committed extent {e:?}");
                }
            }
        }
    }
    for (key, moved) in moves {
        m.finish_move(key, moved);
        m.moves_resolved_by_crash += 1;
    }
    if let Some((gone, _)) = c.removing {
        let pbx = |e: &metaslab::Extent| pb::Extent {
            vdev: e.vdev,
            offset: e.offset,
            size: e.size,
        };
        let olds: HashSet<(u32, u64)> = p
            .mappings
            .iter()
            .map(|mp| (mp.from.vdev, mp.from.offset))
            .collect();
        let has = |e: &pb::Extent| exact.contains(&(e.vdev, e.offset, e.size));
        for mp in &p.mappings {
            let (from, to) = (pbx(&mp.from), pbx(&mp.to));
            assert_eq!(
                from.vdev, gone,
                "a mapping entry off the removed vdev: {from:?}"
            );
            assert_ne!(
                to.vdev, gone,
                "{from:?} mapped onto the removed vdev: {to:?}"
            );
            // The old extent stays allocated behind its entry.
            assert!(
                has(&from),
                "entry {from:?} -> {to:?}: the old extent is not held"
            );
            assert!(
                has(&to),
                "entry {from:?} -> {to:?}: the new extent is not allocated"
            );
            assert!(!olds.contains(&(to.vdev, to.offset)), "a chain at {to:?}");
            m.learn_move(&from, &to);
        }
        // Exactly one live copy of each block: every allocated extent is
        // one the writer holds, or the new home of one it holds.
        for e in &p.allocated {
            let held = m
                .index
                .get(&(e.vdev, e.offset))
                .is_some_and(|&(end, _)| end == e.offset + e.size);
            assert!(
                held,
                "{e:?} is allocated in the store but held by no block (a second copy of a moved block?)"
            );
        }
        // And every move the writer learned is still recorded (unless
        // its block's free may have synced).
        for (&(v, o), to) in &m.moved {
            let (_, key) = m.index[&(v, o)];
            assert!(
                olds.contains(&(v, o)) || m.blocks[&key].st == St::Freeing,
                "the entry of moved block {v}:{o:#x} -> {to:?} is gone from the store"
            );
        }
        m.store_mappings = m.store_mappings.max(p.mappings.len());
    }
    // The operator's tool on the stopped pool says the same.
    let mut verify = std::process::Command::new(bin("aliquotctl"));
    match &c.pg {
        Some(pg) => verify.args(["verify", "--pool", "crash", "--store", &pg.url()]),
        None => verify.args(["verify", "--db"]).arg(c.db()),
    };
    let out = verify.output().expect("run aliquotctl verify");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "aliquotctl verify failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// How a call rides out a leader whose lease lapsed for a moment (a
/// renewal late on a loaded machine): it says NOT_LEADER until it renews,
/// and a client retries, as the client library does, for up to 20 s.
const THROUGH_LAPSES: Retry = Retry::within(Duration::from_secs(20))
    .delays(Duration::from_millis(50), Duration::from_millis(500));

/// After a restart: re-assert what may have been lost (Claim), finish the
/// frees that may have been lost, and make it all durable.
async fn resolve(c: &mut Cluster, m: &mut Model) {
    for key in m.keys(|s| matches!(s, St::CommitSent | St::Committed(_))) {
        let extents = m.blocks[&key].extents.clone();
        let client = c.client.clone();
        retry_transient(&THROUGH_LAPSES, || {
            let mut client = client.clone();
            let extents = extents.clone();
            async move {
                client
                    .claim(pb::ClaimRequest {
                        extents,
                        per_extent: false,
                        allocation_ids: Vec::new(),
                    })
                    .await
                    .map(tonic::Response::into_inner)
            }
        })
        .await
        .unwrap_or_else(|e| panic!("claim of our own {extents:?} failed: {e}"));
        m.claims += 1;
        m.blocks.get_mut(&key).unwrap().st = St::Committed(u64::MAX);
    }
    for key in m.keys(|s| s == St::Freeing) {
        let extents = m.blocks[&key].extents.clone();
        let client = c.client.clone();
        let freed = retry_transient(&THROUGH_LAPSES, || {
            let mut client = client.clone();
            let extents = extents.clone();
            async move { free_after_moves(&mut client, extents).await }
        })
        .await;
        match freed {
            Ok(_) => {}
            // The free was durable before the crash.
            Err(e) if e.code() == Code::FailedPrecondition => {}
            Err(e) => panic!("free again: {e}"),
        }
        m.remove(key);
    }
    let client = c.client.clone();
    let s = retry_transient(&THROUGH_LAPSES, || {
        let mut client = client.clone();
        async move {
            client
                .sync_txg(pb::SyncTxgRequest {
                    txg: 0,
                    ..Default::default()
                })
                .await
                .map(tonic::Response::into_inner)
        }
    })
    .await
    .expect("sync after recovery")
    .synced_txg;
    for b in m.blocks.values_mut() {
        if let St::Committed(_) = b.st {
            b.st = St::Durable;
        }
    }
    // Txg numbers restart from the store's: old acks say nothing any more.
    m.known_synced = s;
}

/// Read back every durable extent (or those of one vdev).
async fn check_patterns(c: &mut Cluster, m: &mut Model, only: Option<u32>) {
    let mut n = 0;
    let blocks: Vec<Block> = m
        .blocks
        .values()
        .filter(|b| b.st == St::Durable)
        .cloned()
        .collect();
    let wanted: Vec<(u64, pb::Extent)> = blocks
        .iter()
        .flat_map(|b| b.ids.iter().copied().zip(b.extents.iter().copied()))
        .filter(|(_, e)| only.is_none_or(|v| v == e.vdev))
        .collect();
    // Reads need the owner's read tokens when the pool signs tokens; a
    // moved block's old address reads where ReadTokens says it is now.
    let mut tokens: Vec<Vec<u8>> = Vec::new();
    let mut at: Vec<pb::Extent> = wanted.iter().map(|(_, e)| *e).collect();
    if c.secure() || c.removing.is_some() {
        at.clear();
        for chunk in wanted.chunks(4096) {
            let client = c.client.clone();
            let extents: Vec<pb::Extent> = chunk.iter().map(|(_, e)| *e).collect();
            let r = retry_transient(&THROUGH_LAPSES, || {
                let mut client = client.clone();
                let extents = extents.clone();
                async move {
                    client
                        .read_tokens(pb::ReadTokensRequest { extents })
                        .await
                        .map(tonic::Response::into_inner)
                }
            })
            .await
            .unwrap_or_else(|e| panic!("read tokens of the writer's own blocks: {e}"));
            tokens.extend(r.tokens);
            assert_eq!(r.locations.len(), extents.len(), "a location per extent");
            at.extend(r.locations);
        }
    }
    for ((_, e), to) in wanted.iter().zip(&at) {
        if to != e {
            assert_eq!(
                c.removing.map(|r| r.0),
                Some(e.vdev),
                "{e:?} reads at {to:?}: only the removed vdev's blocks move"
            );
            m.learn_move(e, to);
        }
    }
    for (k, (id, asked)) in wanted.iter().enumerate() {
        {
            let mut e = at[k];
            // An agent just restarted checks read tokens only once it has
            // registered again, and until then says UNAVAILABLE, retry: a
            // client retries, and so does the test.
            // A token granted before the agent registered again is refused
            // (it cannot know what was written meanwhile): ask again.
            let deadline = Instant::now() + Duration::from_secs(20);
            let data = loop {
                let ep = c.endpoints[&e.vdev].clone();
                let r = c
                    .agent(&ep)
                    .read(pb::ReadRequest {
                        offset: e.offset,
                        size: e.size,
                        token: tokens.get(k).cloned().unwrap_or_default(),
                    })
                    .await;
                match r {
                    Ok(r) => break r.into_inner().data,
                    Err(err) if err.code() == Code::Unavailable && Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(err)
                        if reason(&err) == "READ_TOKEN_BEFORE_AGENT_START"
                            && Instant::now() < deadline =>
                    {
                        let t = c
                            .client
                            .read_tokens(pb::ReadTokensRequest {
                                extents: vec![*asked],
                            })
                            .await
                            .unwrap_or_else(|e| panic!("read token again: {e}"))
                            .into_inner();
                        // The mover may have moved it meanwhile.
                        let loc = t.locations.first().copied().unwrap_or(*asked);
                        if loc != e {
                            assert_eq!(e, *asked, "{asked:?} moved twice");
                            m.learn_move(asked, &loc);
                            e = loc;
                        }
                        tokens[k] = t.tokens.into_iter().next().unwrap_or_default();
                    }
                    Err(err) => panic!("read {e:?} from {ep}: {err}"),
                }
            };
            assert!(
                data == pattern(*id, e.size as usize),
                "extent {}:{:#x}+{:#x} (pattern {id}, read at {e:?}) lost its data",
                asked.vdev,
                asked.offset,
                asked.size,
            );
            if e != *asked {
                m.read_through_mapping += 1;
            }
            n += 1;
        }
    }
    m.verified_extents += n;
}

/// Set the mover's pace (bytes/s), as an operator does at run time.
async fn set_move_rate(c: &mut Cluster, rate: u64) {
    let client = c.client.clone();
    retry_transient(&THROUGH_LAPSES, || {
        let mut client = client.clone();
        async move {
            client
                .set_tunable(pb::SetTunableRequest {
                    name: "move_rate".into(),
                    value: rate.to_string(),
                })
                .await
                .map(tonic::Response::into_inner)
        }
    })
    .await
    .unwrap_or_else(|e| panic!("set move_rate: {e}"));
}

/// Write a while on every vdev, then remove the extra agent's vdev: its
/// blocks move, slowly enough that the faults to come land mid-evacuation.
async fn start_removal(c: &mut Cluster, m: &mut Model, rng: &mut Rng) {
    let source = AGENTS;
    let vdev = vdev_of(c, source);
    // Until it holds blocks enough for the faults to land mid-evacuation
    // (a vdev just joined may take a report or two to be given any).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        write_until(c, m, rng, Instant::now() + Duration::from_millis(500)).await;
        let on_it = m
            .blocks
            .values()
            .filter(|b| b.extents.iter().any(|e| e.vdev == vdev))
            .count();
        if on_it >= 40 {
            break;
        }
        assert!(Instant::now() < deadline, "{on_it} blocks on vdev {vdev}");
    }
    // Nothing left in flight on it: its removal would wait for the lease.
    abort_inflight(c, m).await;
    let s = c.pool().await;
    let alloc = s
        .vdevs
        .iter()
        .find(|v| v.vdev == vdev)
        .map_or(0, |v| v.alloc);
    // About eight seconds of moves.
    set_move_rate(c, (alloc / 8).max(64 << 10)).await;
    let r = c
        .client
        .remove_vdev(pb::RemoveVdevRequest { vdev })
        .await
        .unwrap_or_else(|e| panic!("remove vdev {vdev}: {e}"))
        .into_inner();
    assert!(r.evacuating, "{r:?}");
    // Every commit acknowledged so far is in the txg that took it offline.
    m.synced(r.txg);
    c.removing = Some((vdev, source));
    eprintln!(
        "removal of vdev {vdev}: {} blocks, {} bytes to move",
        r.extents, r.bytes
    );
}

/// Let the evacuation finish, then check with the allocator dead: every
/// block of the removed vdev moved exactly once; with its agent gone and
/// its file deleted, every durable block reads back through its original
/// address.
async fn finish_removal(c: &mut Cluster, m: &mut Model, mid_evacuation: usize) {
    let (vdev, source) = c.removing.expect("a removal");
    set_move_rate(c, 256 << 20).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = c.pool().await;
        if s.evacuation
            .as_ref()
            .is_some_and(|e| e.vdev == vdev && e.done)
            || !s.vdevs.iter().any(|v| v.vdev == vdev)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the evacuation of vdev {vdev} never finished: {:?}",
            s.evacuation
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    abort_inflight(c, m).await;
    c.kill_allocator();
    check_store(c, m).await;
    c.restart_allocator().await;
    resolve(c, m).await;
    let left: Vec<pb::Extent> = m
        .blocks
        .values()
        .flat_map(|b| b.extents.iter().copied())
        .filter(|e| e.vdev == vdev && !m.moved.contains_key(&(e.vdev, e.offset)))
        .collect();
    assert!(
        left.is_empty(),
        "blocks never moved off vdev {vdev}: {left:?}"
    );
    c.agents[source].kill9();
    std::fs::remove_file(c.dir.join(format!("v{source}.img"))).expect("remove its file");
    let before = m.read_through_mapping;
    check_patterns(c, m, None).await;
    // Each copy that joined its other copy's vdev was a move the allocator
    // said it could not keep apart (its logs, every allocator's).
    let warned: usize = ["allocator", "allocator-b"]
        .iter()
        .map(|n| {
            std::fs::read_to_string(c.dir.join(format!("{n}.log")))
                .unwrap_or_default()
                .matches("this copy may share a vdev with another copy")
                .count()
        })
        .sum();
    assert!(
        m.copies_joined <= warned as u64,
        "{} copies joined their block's other copy, {warned} such moves announced",
        m.copies_joined
    );
    eprintln!(
        "crash test (removal): {} blocks moved off vdev {vdev} ({} entries at most in one \
         store check), {} faults mid-evacuation; {} reads through an old address, {} of \
         them with its agent gone; {} copies moved onto their block's other copy's vdev \
         ({} such moves announced: no other vdev could take them)",
        m.moved.len(),
        m.store_mappings,
        mid_evacuation,
        m.read_through_mapping,
        m.read_through_mapping - before,
        m.copies_joined,
        warned
    );
    assert!(
        m.read_through_mapping > before,
        "no block read through a mapping"
    );
    assert!(mid_evacuation > 0, "no fault hit the evacuation");
}

/// Abort what was left uncommitted (rounds without an allocator crash).
async fn abort_inflight(c: &mut Cluster, m: &mut Model) {
    for key in m.keys(|s| s == St::Inflight) {
        if m.abandoned.contains(&key) {
            continue;
        }
        let id = m.blocks[&key].alloc_id;
        c.client
            .abort(pb::AbortRequest {
                allocation_ids: vec![id],
            })
            .await
            .expect("abort");
        m.remove(key);
    }
}

#[derive(Clone, Copy, Debug)]
enum Kill {
    Allocator,
    Agent,
    Both,
    /// SIGSTOP an agent for longer than the write deadline, then SIGCONT.
    Hang,
    /// SIGSTOP an agent, kill -9 and restart the allocator, SIGCONT: nothing
    /// may be placed on the sleeping agent's vdev meanwhile (it does not
    /// know the new generation).
    HangAcrossRestart,
    /// Restart the allocator on an older copy of its store: refused
    /// (STORE_ROLLED_BACK) until the newest store is put back.
    Rollback,
    /// On PostgreSQL: SIGSTOP the leader instead of killing it; the standby
    /// takes over with the stopped one's agents, then it is woken (SIGCONT)
    /// and must answer NOT_LEADER (and persist nothing: the store is
    /// checked at the next fault) before it is restarted as the standby.
    LeaderStop,
    /// On PostgreSQL: pause the leader's path to the store inside a
    /// transaction for three leases; the standby takes over meanwhile, and
    /// the old leader, its path back, persists nothing and answers
    /// NOT_LEADER before it is restarted as the standby.
    PgPause,
    /// kill -9 of the agent of the vdev being removed (the mover's source),
    /// then its restart.
    SourceAgent,
}

fn copy_store(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// The vdev an agent serves.
fn vdev_of(c: &Cluster, agent: usize) -> u32 {
    let port = c.agents[agent].addr("grpc").port();
    c.endpoints
        .iter()
        .find(|(_, ep)| port_of(ep) == port)
        .map(|(v, _)| *v)
        .unwrap()
}

/// What a run injects, and how the pool is deployed.
#[derive(Clone, Copy, Default)]
struct Faults {
    allocator_kills: usize,
    agent_kills: usize,
    both_kills: usize,
    /// SIGSTOP an agent past the writer's deadline, then SIGCONT.
    hangs: usize,
    hangs_across_restarts: usize,
    rollbacks: usize,
    /// SIGSTOP of the leader (needs `ha`).
    leader_stops: usize,
    /// The leader's path to PostgreSQL paused mid-transaction (needs `ha`).
    pg_pauses: usize,
    /// Two allocators on PostgreSQL: every allocator kill is a takeover
    /// (rollbacks, which copy an SQLite file, need `ha` false).
    ha: bool,
    /// Mutual TLS, tokens and owners; the other actors attack (module docs).
    secure: bool,
    /// One more agent, whose vdev is removed (RemoveVdev) before the
    /// faults: they hit while the allocator's mover evacuates it.
    removal: bool,
    /// kill -9 of the removed vdev's agent (needs `removal`).
    source_kills: usize,
}

async fn crash_run(f: Faults) {
    let Faults {
        allocator_kills,
        agent_kills,
        both_kills,
        hangs,
        hangs_across_restarts,
        rollbacks,
        leader_stops,
        pg_pauses,
        ha,
        secure,
        removal,
        source_kills,
    } = f;
    assert!(
        removal || source_kills == 0,
        "a source agent needs a removal"
    );
    assert!(!(ha && rollbacks > 0), "rollbacks copy the SQLite store");
    assert!(
        ha || leader_stops + pg_pauses == 0,
        "a stopped leader needs a standby"
    );
    let seed = std::env::var("ALIQUOT_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("crash test seed {seed} (ALIQUOT_CRASH_SEED={seed} replays it)");
    let mut rng = Rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start_with(tmp.path(), ha, secure, AGENTS + usize::from(removal)).await;
    let mut m = Model::default();
    let mut plan: Vec<Kill> = std::iter::repeat_n(Kill::Allocator, allocator_kills)
        .chain(std::iter::repeat_n(Kill::Agent, agent_kills))
        .chain(std::iter::repeat_n(Kill::Both, both_kills))
        .chain(std::iter::repeat_n(Kill::Hang, hangs))
        .chain(std::iter::repeat_n(
            Kill::HangAcrossRestart,
            hangs_across_restarts,
        ))
        .chain(std::iter::repeat_n(Kill::Rollback, rollbacks))
        .chain(std::iter::repeat_n(Kill::LeaderStop, leader_stops))
        .chain(std::iter::repeat_n(Kill::PgPause, pg_pauses))
        .chain(std::iter::repeat_n(Kill::SourceAgent, source_kills))
        .collect();
    let mut refused_placements = 0u64;
    let mut rollbacks_refused = 0u64;
    for i in (1..plan.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        plan.swap(i, j);
    }
    let started = Instant::now();
    if removal {
        start_removal(&mut c, &mut m, &mut rng).await;
    }
    // Faults that hit while the mover was copying, with some blocks moved.
    let mut mid_evacuation = 0;
    for (round, kill) in plan.iter().enumerate() {
        let run_for = Duration::from_millis(100 + rng.below(500));
        let evac = match c.removing {
            Some(_) => c.pool().await.evacuation,
            None => None,
        };
        if let Some(e) = &evac {
            if !e.done && e.copied_extents > 0 {
                mid_evacuation += 1;
            }
            eprintln!(
                "round {round:>3}: evacuation {} of {} blocks copied{}",
                e.copied_extents,
                e.total_extents,
                if e.done { ", done" } else { "" }
            );
        }
        match kill {
            Kill::Allocator | Kill::Both => {
                tokio::select! {
                    _ = write_forever(&mut c, &mut m, &mut rng) => unreachable!(),
                    _ = tokio::time::sleep(run_for) => {}
                }
                c.kill_allocator();
                let victim = rng.below(AGENTS as u64) as usize;
                if matches!(kill, Kill::Both) {
                    c.agents[victim].kill9();
                }
                check_store(&mut c, &mut m).await;
                if matches!(kill, Kill::Both) {
                    c.agents[victim].restart().expect("restart agent");
                    c.unsettle();
                }
                c.restart_allocator().await;
                resolve(&mut c, &mut m).await;
                check_patterns(&mut c, &mut m, None).await;
            }
            Kill::LeaderStop => {
                tokio::select! {
                    _ = write_forever(&mut c, &mut m, &mut rng) => unreachable!(),
                    _ = tokio::time::sleep(run_for) => {}
                }
                c.stop_allocator();
                check_store(&mut c, &mut m).await;
                c.restart_allocator().await;
                resolve(&mut c, &mut m).await;
                check_patterns(&mut c, &mut m, None).await;
            }
            Kill::PgPause => {
                c.arm_pause();
                tokio::select! {
                    _ = write_forever(&mut c, &mut m, &mut rng) => unreachable!(),
                    _ = tokio::time::sleep(run_for) => {}
                }
                c.wait_paused().await;
                check_store(&mut c, &mut m).await;
                c.restart_allocator().await;
                resolve(&mut c, &mut m).await;
                check_patterns(&mut c, &mut m, None).await;
            }
            Kill::Agent | Kill::SourceAgent => {
                write_until(&mut c, &mut m, &mut rng, Instant::now() + run_for).await;
                // The removed vdev's agent only when asked for: a target of
                // the moves otherwise.
                let victim = match (kill, c.removing) {
                    (Kill::SourceAgent, Some((_, source))) => source,
                    _ => rng.below(AGENTS as u64) as usize,
                };
                let vdev = vdev_of(&c, victim);
                c.agents[victim].kill9();
                c.away = Some(vdev);
                // Writes to it fail and are aborted; the rest goes on.
                let down = Duration::from_millis(100 + rng.below(300));
                write_until(&mut c, &mut m, &mut rng, Instant::now() + down).await;
                c.agents[victim].restart().expect("restart agent");
                c.away = None;
                c.unsettle();
                check_patterns(&mut c, &mut m, Some(vdev)).await;
                abort_inflight(&mut c, &mut m).await;
                assert_eq!(c.agent_of_vdev(vdev), victim);
            }
            Kill::Hang => {
                write_until(&mut c, &mut m, &mut rng, Instant::now() + run_for).await;
                let victim = rng.below(AGENTS as u64) as usize;
                let vdev = vdev_of(&c, victim);
                signal(&c.agents[victim], "-STOP");
                c.away = Some(vdev);
                // Writes to it time out and are left to their lease; the
                // rest goes on (the allocator stays alive: errors are bugs).
                let hung = WRITE_DEADLINE * 2 + Duration::from_millis(rng.below(1000));
                write_until(&mut c, &mut m, &mut rng, Instant::now() + hung).await;
                signal(&c.agents[victim], "-CONT");
                c.away = None;
                c.unsettle();
                // Its durable blocks are intact after the late writes landed.
                check_patterns(&mut c, &mut m, Some(vdev)).await;
            }
            Kill::HangAcrossRestart => {
                write_until(&mut c, &mut m, &mut rng, Instant::now() + run_for).await;
                let victim = rng.below(AGENTS as u64) as usize;
                let vdev = vdev_of(&c, victim);
                signal(&c.agents[victim], "-STOP");
                c.kill_allocator();
                check_store(&mut c, &mut m).await;
                c.asleep = Some(vdev);
                c.restart_allocator().await;
                resolve(&mut c, &mut m).await;
                // The other agents report in; the sleeping one cannot: not
                // one allocation may land on its vdev.
                let until = Instant::now() + Duration::from_millis(800);
                while Instant::now() < until {
                    match c.client.allocate(data_req(64 << 10)).await {
                        Ok(r) => {
                            let r = r.into_inner();
                            assert!(
                                r.extents.iter().all(|e| e.vdev != vdev),
                                "placed {:?} on vdev {vdev}, whose agent slept through the restart",
                                r.extents
                            );
                            c.client
                                .abort(pb::AbortRequest {
                                    allocation_ids: vec![r.allocation_id],
                                })
                                .await
                                .expect("abort");
                            refused_placements += 1;
                        }
                        Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                signal(&c.agents[victim], "-CONT");
                c.asleep = None;
                c.unsettle();
                tokio::time::sleep(Duration::from_millis(600)).await;
                check_patterns(&mut c, &mut m, None).await;
            }
            Kill::Rollback => {
                write_until(&mut c, &mut m, &mut rng, Instant::now() + run_for).await;
                c.kill_allocator();
                check_store(&mut c, &mut m).await;
                let store_dir = c.dir.join("allocator");
                let older = c.dir.join("older-store");
                copy_store(&store_dir, &older);
                c.restart_allocator().await;
                resolve(&mut c, &mut m).await;
                // More synced txgs, and time for the labels to record them.
                write_until(&mut c, &mut m, &mut rng, Instant::now() + run_for).await;
                c.client
                    .sync_txg(pb::SyncTxgRequest::default())
                    .await
                    .expect("sync");
                tokio::time::sleep(Duration::from_millis(800)).await;
                c.kill_allocator();
                check_store(&mut c, &mut m).await;
                let newest = c.dir.join("newest-store");
                copy_store(&store_dir, &newest);
                copy_store(&older, &store_dir);
                c.restart_allocator_on_any_store().await;
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    match c.client.allocate(data_req(64 << 10)).await {
                        Ok(r) => panic!(
                            "the allocator served an older store: {:?}",
                            r.into_inner().extents
                        ),
                        Err(e) if e.code() == Code::FailedPrecondition => {
                            assert!(e.message().contains("--rewind-to"), "{e}");
                            break;
                        }
                        Err(e) => {
                            assert!(Instant::now() < deadline, "never refused: {e}");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
                rollbacks_refused += 1;
                // The operator puts the newest store back.
                c.kill_allocator();
                copy_store(&newest, &store_dir);
                c.restart_allocator().await;
                resolve(&mut c, &mut m).await;
                check_patterns(&mut c, &mut m, None).await;
            }
        }
        eprintln!(
            "round {round:>3} {kill:?}: {} blocks held, {} durable acks, {} allocations",
            m.blocks.len(),
            m.durable_acks,
            m.allocations
        );
    }
    if removal {
        finish_removal(&mut c, &mut m, mid_evacuation).await;
    }
    // Let agents re-register everywhere: still the same three vdevs (and
    // the removed one, until its last moved block is freed).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = c.pool().await;
    let removed = c.removing.map(|r| r.0);
    assert_eq!(
        s.vdevs.iter().filter(|v| Some(v.vdev) != removed).count(),
        AGENTS,
        "no device became a second vdev"
    );
    let elapsed = started.elapsed();
    eprintln!(
        "crash test: {} kills ({allocator_kills} allocator, {agent_kills} agent, {both_kills} both, {hangs} hung agents) in {:.1} s; \
         {} allocations, {} acknowledged synced, {} frees, {} claims, {} aborts, \
         {} uncommitted allocations checked free, {} extent read-backs verified, \
         {} duplicated commits answered alike, {} agent writes timed out (left to the lease)",
        plan.len(),
        elapsed.as_secs_f64(),
        m.allocations,
        m.durable_acks,
        m.frees,
        m.claims,
        m.aborts,
        m.lost_uncommitted,
        m.verified_extents,
        m.dup_commits,
        m.write_timeouts
    );
    eprintln!(
        "crash test: {hangs_across_restarts} agents slept through allocator restarts \
         ({refused_placements} placements meanwhile, none on a sleeping agent's vdev); \
         {rollbacks_refused} of {rollbacks} older stores refused"
    );
    if leader_stops > 0 {
        eprintln!(
            "crash test: {} of {leader_stops} stopped leaders, woken after the takeover, answered NOT_LEADER",
            c.woken_refused
        );
        assert_eq!(c.woken_refused, leader_stops as u64);
    }
    if pg_pauses > 0 {
        eprintln!(
            "crash test: {} of {pg_pauses} leaders whose path to PostgreSQL was paused \
             mid-transaction for three leases answered NOT_LEADER once it came back",
            c.unpaused_refused
        );
        assert_eq!(c.unpaused_refused, pg_pauses as u64);
    }
    if !c.takeovers.is_empty() {
        let mut t = c.takeovers.clone();
        t.sort();
        eprintln!(
            "crash test: {} faults, {} takeovers, kill/stop/pause to serving (store checked \
             meanwhile): p50 {:?}, max {:?}; 0 durable blocks lost, 0 extents held twice \
             (each checked at every fault)",
            plan.len(),
            t.len(),
            t[t.len() / 2],
            t[t.len() - 1]
        );
    }
    if secure {
        eprintln!(
            "crash test (secure): another client's attempts refused {:?}; replayed tokens refused {:?}, \
             {} landed on space nobody held; {} moves committed ({} resolved by a crash)",
            m.foreign_refused,
            m.replays_refused,
            m.replays_on_free_space,
            m.moves,
            m.moves_resolved_by_crash
        );
        assert!(
            !m.foreign_refused.is_empty() && !m.replays_refused.is_empty() && m.moves > 0,
            "the attacks ran"
        );
    }
    assert_eq!(rollbacks_refused, rollbacks as u64);
    assert!(m.durable_acks > 0 && m.verified_extents > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_allocator_and_agents_loses_nothing_durable() {
    crash_run(Faults {
        allocator_kills: 20,
        agent_kills: 4,
        both_kills: 4,
        hangs: 3,
        ..Faults::default()
    })
    .await;
}

/// Agents asleep across allocator restarts, and
/// restarts on an older copy of the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_asleep_across_restarts_and_rolled_back_stores_lose_nothing() {
    crash_run(Faults {
        allocator_kills: 4,
        hangs_across_restarts: 3,
        rollbacks: 2,
        ..Faults::default()
    })
    .await;
}

/// Over mutual TLS: another client frees, reads and claims, the
/// mover relocates, old tokens are replayed, among kills and hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_tokens_and_moves_under_faults_lose_nothing() {
    crash_run(Faults {
        allocator_kills: 6,
        agent_kills: 2,
        both_kills: 2,
        hangs: 2,
        hangs_across_restarts: 1,
        rollbacks: 1,
        secure: true,
        ..Faults::default()
    })
    .await;
}

/// The same faults with two allocators on PostgreSQL; each
/// allocator kill is a takeover by the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeovers_on_postgres_lose_nothing_durable() {
    let n = std::env::var("ALIQUOT_CRASH_SCALE")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    crash_run(Faults {
        allocator_kills: 6 * n,
        leader_stops: 3 * n,
        pg_pauses: 2 * n,
        agent_kills: 2 * n,
        both_kills: 2 * n,
        hangs: n,
        hangs_across_restarts: 2 * n,
        ha: true,
        ..Faults::default()
    })
    .await;
}

/// A vdev removed (its blocks moved by the allocator's mover) while the
/// leader, the removed vdev's agent and the agents receiving its blocks are
/// killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removal_under_kills_moves_every_block_once() {
    crash_run(Faults {
        allocator_kills: 4,
        agent_kills: 2,
        both_kills: 1,
        source_kills: 2,
        removal: true,
        ..Faults::default()
    })
    .await;
}

/// The same on PostgreSQL: the mover resumes in the leader that takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removal_under_takeovers_on_postgres_moves_every_block_once() {
    crash_run(Faults {
        allocator_kills: 3,
        leader_stops: 1,
        agent_kills: 1,
        source_kills: 1,
        removal: true,
        ha: true,
        ..Faults::default()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: many takeovers on PostgreSQL"]
async fn takeovers_on_postgres_many_times() {
    crash_run(Faults {
        allocator_kills: 50,
        leader_stops: 10,
        pg_pauses: 10,
        agent_kills: 10,
        both_kills: 10,
        hangs: 5,
        hangs_across_restarts: 10,
        ha: true,
        ..Faults::default()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: 235 faults over mutual TLS, several minutes"]
async fn kill9_many_times() {
    crash_run(Faults {
        allocator_kills: 150,
        agent_kills: 25,
        both_kills: 25,
        hangs: 10,
        hangs_across_restarts: 15,
        rollbacks: 10,
        secure: true,
        ..Faults::default()
    })
    .await;
}
