//! Which roles may call which gRPC method: the one table of the pool's
//! authorization. Anything not listed is refused (deny by default), so a
//! new RPC must be placed here before anyone can call it.
//!
//! Finer bindings live with the state they bind and use the caller's
//! [`Identity`](crate::Identity) from the request extensions: an agent
//! registers and reports only its own device, and Commit/Abort/RenewLease/
//! Written are honoured only for the identity that allocated.

use crate::role::Role;

use Role::{Admin, Agent, Allocator, Client, Metrics};

const ANY: &[Role] = &[Agent, Client, Admin, Allocator, Metrics];
const CLIENTS: &[Role] = &[Client, Admin];
const ADMIN: &[Role] = &[Admin];
const AGENTS: &[Role] = &[Agent];
const ALLOCATOR: &[Role] = &[Allocator];
/// Pool and metrics reads: clients, operators, and the services themselves.
const READERS: &[Role] = &[Client, Admin, Allocator, Metrics];

/// The roles allowed to call `path` (`/package.Service/Method`), or None
/// for a method no role may call.
pub fn allowed(path: &str) -> Option<&'static [Role]> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    Some(match (service, method) {
        // Health and reflection describe, they do not change: any pool member.
        ("grpc.health.v1.Health", _) => ANY,
        ("grpc.reflection.v1.ServerReflection", _)
        | ("grpc.reflection.v1alpha.ServerReflection", _) => ANY,

        ("aliquot.v1.Allocator", m) => match m {
            "Allocate" | "AllocateStream" | "Commit" | "Abort" | "RenewLease" | "Written"
            | "Free" | "Claim" | "SyncTxg" | "ReadTokens" | "Remap" => CLIENTS,
            "GetPool" | "WatchPool" | "GetTunables" => READERS,
            // AdmitVdev adds capacity, as `zpool add` does: operators only.
            "SetTunable" | "SetVdevState" | "ExpandVdev" | "AdmitVdev" => ADMIN,
            // A plan names other clients' extents, and a relocation's commit
            // frees the extent it moves: operators (the mover) only.
            "PlanRebalance" | "Relocate" | "RemoveVdev" => ADMIN,
            // Moves the pool to another allocator: operators only.
            "StepDown" => ADMIN,
            "BalancerStatus" => READERS,
            _ => return None,
        },
        ("aliquot.v1.AgentRegistry", "Register" | "Report") => AGENTS,

        ("aliquot.v1.VdevAgent", m) => match m {
            // Writes also need a write token; reads a read token.
            "Write" | "WriteBatch" | "Read" | "Flush" => CLIENTS,
            // An agent reads another (with the allocator's read token) only
            // to copy a block for the allocator's mover (CopyFrom).
            "ReadForCopy" => AGENTS,
            // Only the allocator moves blocks between agents.
            "CopyFrom" => ALLOCATOR,
            "GetStats" => READERS,
            "SetTunables" => ADMIN,
            _ => return None,
        },

        ("aliquot.v1.Metrics", m) => match m {
            "RecordSnapshots" | "RecordBatch" => ALLOCATOR,
            "History" | "Summary" => READERS,
            _ => return None,
        },
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let can = |role: Role, path: &str| allowed(path).is_some_and(|r| r.contains(&role));
        assert!(can(Client, "/aliquot.v1.Allocator/Allocate"));
        assert!(!can(Agent, "/aliquot.v1.Allocator/Allocate"));
        assert!(can(Client, "/aliquot.v1.Allocator/Written"));
        assert!(!can(Agent, "/aliquot.v1.Allocator/Written"));
        assert!(!can(Client, "/aliquot.v1.AgentRegistry/Register"));
        assert!(!can(Client, "/aliquot.v1.AgentRegistry/Report"));
        assert!(can(Agent, "/aliquot.v1.AgentRegistry/Report"));
        assert!(!can(Client, "/aliquot.v1.Allocator/SetTunable"));
        assert!(can(Admin, "/aliquot.v1.Allocator/SetVdevState"));
        assert!(can(Admin, "/aliquot.v1.Allocator/ExpandVdev"));
        assert!(!can(Client, "/aliquot.v1.Allocator/ExpandVdev"));
        assert!(can(Admin, "/aliquot.v1.Allocator/AdmitVdev"));
        assert!(!can(Agent, "/aliquot.v1.Allocator/AdmitVdev"));
        assert!(!can(Client, "/aliquot.v1.Allocator/AdmitVdev"));
        assert!(can(Admin, "/aliquot.v1.Allocator/PlanRebalance"));
        assert!(!can(Client, "/aliquot.v1.Allocator/PlanRebalance"));
        assert!(can(Admin, "/aliquot.v1.Allocator/Relocate"));
        assert!(!can(Client, "/aliquot.v1.Allocator/Relocate"));
        assert!(can(Admin, "/aliquot.v1.Allocator/RemoveVdev"));
        assert!(!can(Client, "/aliquot.v1.Allocator/RemoveVdev"));
        assert!(can(Client, "/aliquot.v1.Allocator/BalancerStatus"));
        assert!(!can(Agent, "/aliquot.v1.Allocator/BalancerStatus"));
        assert!(can(Admin, "/aliquot.v1.Allocator/Free"));
        assert!(!can(Client, "/aliquot.v1.Metrics/RecordBatch"));
        assert!(can(Allocator, "/aliquot.v1.Metrics/RecordSnapshots"));
        assert!(!can(Agent, "/aliquot.v1.VdevAgent/Read"));
        assert!(can(Agent, "/aliquot.v1.VdevAgent/ReadForCopy"));
        assert!(!can(Client, "/aliquot.v1.VdevAgent/ReadForCopy"));
        assert!(can(Allocator, "/aliquot.v1.VdevAgent/CopyFrom"));
        assert!(!can(Client, "/aliquot.v1.VdevAgent/CopyFrom"));
        assert!(!can(Admin, "/aliquot.v1.VdevAgent/CopyFrom"));
        // A batch of writes is a write: the same roles (and tokens).
        for role in [Client, Admin, Agent, Allocator] {
            assert_eq!(
                can(role, "/aliquot.v1.VdevAgent/WriteBatch"),
                can(role, "/aliquot.v1.VdevAgent/Write"),
                "{role:?}"
            );
        }
        assert!(can(Agent, "/grpc.health.v1.Health/Check"));
        assert_eq!(allowed("/aliquot.v1.Allocator/NewThing"), None);
        assert_eq!(allowed("garbage"), None);
    }
}
