//! Allocation ids bound to the identity that allocated them. Ids are
//! sequential (guessable), so under mutual TLS the allocator remembers which
//! certificate (role and name) made each in-flight allocation, and Commit,
//! Abort and RenewLease from any other identity are refused with
//! PERMISSION_DENIED, reason NOT_OWNER. An entry lives while its allocation
//! is in flight: it goes at commit, abort and lease expiry. Plaintext
//! (`--insecure`) servers have no identities and record nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aliquot_auth::{Identity, Role};
use metaslab::AllocationId;

use crate::error::{Error, Result};
use crate::state::Inner;

/// The verified caller of a request: its certificate identity and its
/// name ("role/name") made once, per request or per AllocateStream, so the
/// per-allocation bookkeeping clones a pointer, not a string.
#[derive(Clone, Debug)]
pub struct Caller {
    pub identity: Identity,
    pub name: Arc<str>,
}

impl Caller {
    pub fn of(identity: &Identity) -> Caller {
        Caller {
            identity: identity.clone(),
            name: identity.to_string().into(),
        }
    }

    pub fn is_admin(&self) -> bool {
        self.identity.role == Role::Admin
    }

    fn same(&self, name: &Arc<str>) -> bool {
        Arc::ptr_eq(&self.name, name) || *self.name == **name
    }
}

#[derive(Debug, Default)]
pub struct Owners {
    by_id: Mutex<HashMap<AllocationId, Arc<str>>>,
    /// Bytes each identity holds in flight, and each allocation's share
    /// (`--max-leased-per-client`).
    leased: Mutex<Leased>,
    /// Owners of allocations whose lease expired, for a while: a call on
    /// such an id by anyone else is refused NOT_OWNER before its state
    /// (LEASE_EXPIRED) is told.
    expired: Mutex<HashMap<AllocationId, (Arc<str>, Instant)>>,
}

#[derive(Debug, Default)]
struct Leased {
    by_identity: HashMap<Arc<str>, u64>,
    by_id: HashMap<AllocationId, (Arc<str>, u64)>,
}

/// How long, and how many, expired owners are kept (as `Inner::expired`).
const EXPIRED_OWNERS_FOR: Duration = Duration::from_secs(600);
const EXPIRED_OWNERS_MAX: usize = 1 << 20;

impl Owners {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<AllocationId, Arc<str>>> {
        self.by_id.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn expired_map(&self) -> std::sync::MutexGuard<'_, HashMap<AllocationId, (Arc<str>, Instant)>> {
        self.expired.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// These allocations' leases expired: keep their owners for a while.
    pub fn expire(&self, ids: &[AllocationId]) {
        self.release(ids);
        let now = Instant::now();
        let mut m = self.map();
        let mut x = self.expired_map();
        if x.len() > EXPIRED_OWNERS_MAX {
            x.clear();
        }
        x.retain(|_, (_, at)| now.duration_since(*at) < EXPIRED_OWNERS_FOR);
        for id in ids {
            if let Some(owner) = m.remove(id) {
                x.insert(*id, (owner, now));
            }
        }
    }

    /// `caller` made allocation `id` of `bytes` (called before the reply
    /// names it).
    /// `bytes` are counted only under a quota (`count`): the accounting
    /// costs a lock and a map entry per allocation.
    pub fn record(&self, caller: Option<&Caller>, id: AllocationId, bytes: u64, count: bool) {
        if let Some(c) = caller {
            self.map().insert(id, c.name.clone());
            if !count {
                return;
            }
            let mut l = self.leased.lock().unwrap_or_else(|p| p.into_inner());
            *l.by_identity.entry(c.name.clone()).or_default() += bytes;
            l.by_id.insert(id, (c.name.clone(), bytes));
        }
    }

    /// Refuse an allocation of `asked` bytes that would take `caller` past
    /// `quota` bytes in flight (0: no quota; no identity: not counted).
    pub fn check_quota(&self, caller: Option<&Caller>, asked: u64, quota: u64) -> Result<()> {
        let (Some(c), true) = (caller, quota > 0) else {
            return Ok(());
        };
        let held = self
            .leased
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_identity
            .get(&c.name)
            .copied()
            .unwrap_or(0);
        if held.saturating_add(asked) > quota {
            return Err(Error::LeaseQuota {
                caller: c.name.to_string(),
                held,
                asked,
                quota,
            });
        }
        Ok(())
    }

    /// Give back the bytes of allocations no longer in flight.
    fn release(&self, ids: &[AllocationId]) {
        let mut l = self.leased.lock().unwrap_or_else(|p| p.into_inner());
        if l.by_id.is_empty() {
            return;
        }
        for id in ids {
            if let Some((name, bytes)) = l.by_id.remove(id) {
                let left = l
                    .by_identity
                    .get(&name)
                    .map_or(0, |b| b.saturating_sub(bytes));
                if left == 0 {
                    l.by_identity.remove(&name);
                } else {
                    l.by_identity.insert(name, left);
                }
            }
        }
    }

    /// Refuse `action` on `ids` unless `caller` made each of them. Ids
    /// that are not in flight (committed, expired a while ago, unknown)
    /// pass, so the
    /// caller gets the usual answer for them; an in-flight id with no
    /// owner recorded is refused (only a plaintext server makes those).
    pub fn check(
        &self,
        g: &Inner,
        caller: Option<&Caller>,
        ids: &[AllocationId],
        action: &'static str,
    ) -> Result<()> {
        let Some(caller) = caller else {
            return Ok(());
        };
        let m = self.map();
        let x = self.expired_map();
        for &id in ids {
            let mine = match (m.get(&id), x.get(&id)) {
                (Some(owner), _) | (None, Some((owner, _))) => caller.same(owner),
                (None, None) => !g.is_inflight(id),
            };
            if !mine {
                return Err(Error::NotOwnerAllocation {
                    id,
                    caller: caller.name.to_string(),
                    action,
                });
            }
        }
        Ok(())
    }

    /// These allocations are no longer in flight.
    pub fn forget(&self, ids: &[AllocationId]) {
        self.release(ids);
        let mut m = self.map();
        for id in ids {
            m.remove(id);
        }
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
