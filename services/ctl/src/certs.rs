//! `aliquotctl certs init` / `certs issue`: the pool CA and its certificates,
//! in one directory (layout in `aliquot_auth::ca`). `init` also makes the
//! allocator's Ed25519 write-token key pair (`token.key` stays with the
//! allocator, `token.pub` goes to every agent).

use std::path::PathBuf;

use aliquot_auth::{PoolCa, Role};

#[derive(Debug, clap::Args)]
pub struct CertsArgs {
    /// Directory of the pool CA and the certificates it issues.
    #[arg(
        long,
        env = "ALIQUOT_CERTS_DIR",
        default_value = "aliquot-data/certs",
        global = true
    )]
    pub dir: PathBuf,
    #[command(subcommand)]
    pub command: CertsCmd,
}

#[derive(Debug, clap::Subcommand)]
pub enum CertsCmd {
    /// Make the pool CA (ca.pem, ca.key) and the write-token key pair.
    Init {
        /// Pool name, written into the CA's subject.
        #[arg(long, env = "ALIQUOT_POOL", default_value = "tank")]
        pool: String,
    },
    /// Issue a certificate and key: <ROLE>-<NAME>.pem / .key.
    Issue {
        /// agent, client, admin, allocator or metrics.
        #[arg(long, env = "ALIQUOT_CERT_ROLE")]
        role: Role,
        /// Who holds it (a vdev name, a user, a host).
        name: String,
        /// Extra DNS names or IP addresses the holder serves on (repeatable);
        /// `<role>.aliquot` is always in the certificate.
        #[arg(long = "host")]
        hosts: Vec<String>,
    },
    /// Idempotent set-up (compose's one-shot `certs` service): make the CA
    /// unless present, then issue each ROLE:NAME not issued yet.
    Ensure {
        /// Pool name, written into the CA's subject.
        #[arg(long, env = "ALIQUOT_POOL", default_value = "tank")]
        pool: String,
        /// ROLE:NAME to issue unless present (repeatable or comma-separated),
        /// e.g. allocator:allocator,agent:agent1,client:loadgen.
        #[arg(value_delimiter = ',', required = true, value_parser = parse_role_name)]
        certs: Vec<(Role, String)>,
        /// Also copy what each holder needs, and nothing more, into
        /// EXPORT/<NAME>/: ca.pem and its own certificate and key; the
        /// allocator also token.key and token.pub, agents token.pub. ca.key
        /// never leaves --dir (compose mounts one such directory per
        /// container).
        #[arg(long, env = "ALIQUOT_CERTS_EXPORT")]
        export: Option<PathBuf>,
        /// UID:GID to own the exported files (when run as root, e.g. compose's
        /// `certs` service writing volumes for services that run as 10001).
        #[arg(long, env = "ALIQUOT_CERTS_EXPORT_OWNER", requires = "export", value_parser = parse_owner)]
        export_owner: Option<(u32, u32)>,
    },
}

fn parse_owner(s: &str) -> Result<(u32, u32), String> {
    let (u, g) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected UID:GID, e.g. 10001:10001"))?;
    let n = |v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("{s:?}: expected UID:GID, e.g. 10001:10001"))
    };
    Ok((n(u)?, n(g)?))
}

fn parse_role_name(s: &str) -> Result<(Role, String), String> {
    let (role, name) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected ROLE:NAME, e.g. agent:agent1"))?;
    Ok((role.parse()?, name.to_owned()))
}

pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    match args.command {
        CertsCmd::Init { pool } => {
            let ca = PoolCa::init(&args.dir, &pool)?;
            println!(
                "pool CA for {pool} in {} (keep ca.key and token.key private)",
                ca.dir().display()
            );
        }
        CertsCmd::Issue { role, name, hosts } => {
            let issued = PoolCa::open(&args.dir)?.issue(role, &name, &hosts)?;
            println!(
                "{role} {name}: {} {}",
                issued.cert.display(),
                issued.key.display()
            );
        }
        CertsCmd::Ensure {
            pool,
            certs,
            export,
            export_owner,
        } => {
            let ca = PoolCa::open_or_init(&args.dir, &pool)?;
            for (role, name) in certs {
                let issued = ca.ensure_issued(role, &name, &[])?;
                println!("{role} {name}: {}", issued.cert.display());
                if let Some(root) = &export {
                    let to = root.join(&name);
                    export_one(&args.dir, role, &issued, &to, export_owner)?;
                    println!("  exported to {}", to.display());
                }
            }
        }
    }
    Ok(())
}

/// Copy what the holder of `issued` needs into `to` (see `Ensure --export`):
/// written afresh each time, keys 0600.
fn export_one(
    ca_dir: &std::path::Path,
    role: Role,
    issued: &aliquot_auth::ca::Issued,
    to: &std::path::Path,
    owner: Option<(u32, u32)>,
) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(to)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", to.display()))?;
    let mut files: Vec<(PathBuf, bool)> = vec![
        (ca_dir.join(aliquot_auth::ca::CA_CERT), false),
        (issued.cert.clone(), false),
        (issued.key.clone(), true),
    ];
    match role {
        Role::Allocator => {
            files.push((ca_dir.join(aliquot_auth::token::TOKEN_KEY), true));
            files.push((ca_dir.join(aliquot_auth::token::TOKEN_PUB), false));
        }
        Role::Agent => files.push((ca_dir.join(aliquot_auth::token::TOKEN_PUB), false)),
        _ => {}
    }
    for (from, private) in files {
        let name = from
            .file_name()
            .ok_or_else(|| anyhow::anyhow!("{} has no file name", from.display()))?;
        let dest = to.join(name);
        let data = std::fs::read(&from)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", from.display()))?;
        // Replace, not overwrite in place: a reader never sees half a key.
        let tmp = to.join(format!(".{}.tmp", name.to_string_lossy()));
        std::fs::write(&tmp, &data)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", tmp.display()))?;
        let mode = if private { 0o600 } else { 0o644 };
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&tmp, Some(uid), Some(gid))
                .map_err(|e| anyhow::anyhow!("cannot chown {}: {e}", tmp.display()))?;
        }
        std::fs::rename(&tmp, &dest)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", dest.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &std::path::Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Each holder gets its own certificate and key and
    /// ca.pem; only the allocator the token key; nobody ca.key.
    #[test]
    fn export_gives_each_holder_only_what_it_needs() {
        let d = tempfile::tempdir().unwrap();
        let run_ensure = || {
            run(CertsArgs {
                dir: d.path().join("ca"),
                command: CertsCmd::Ensure {
                    pool: "p".into(),
                    certs: vec![
                        (Role::Allocator, "allocator".into()),
                        (Role::Agent, "agent1".into()),
                        (Role::Admin, "operator".into()),
                    ],
                    export: Some(d.path().join("export")),
                    export_owner: None,
                },
            })
            .unwrap()
        };
        run_ensure();
        // Again: idempotent, same files.
        run_ensure();
        let x = d.path().join("export");
        assert_eq!(
            names(&x.join("allocator")),
            [
                "allocator-allocator.key",
                "allocator-allocator.pem",
                "ca.pem",
                "token.key",
                "token.pub"
            ]
        );
        assert_eq!(
            names(&x.join("agent1")),
            [
                "agent-agent1.key",
                "agent-agent1.pem",
                "ca.pem",
                "token.pub"
            ]
        );
        assert_eq!(
            names(&x.join("operator")),
            ["admin-operator.key", "admin-operator.pem", "ca.pem"]
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(x.join("agent1/agent-agent1.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
