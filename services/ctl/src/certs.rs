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
    },
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
        CertsCmd::Ensure { pool, certs } => {
            let ca = PoolCa::open_or_init(&args.dir, &pool)?;
            for (role, name) in certs {
                let issued = ca.ensure_issued(role, &name, &[])?;
                println!("{role} {name}: {}", issued.cert.display());
            }
        }
    }
    Ok(())
}
