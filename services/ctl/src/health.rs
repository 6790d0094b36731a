//! `aliquotctl health URL`: a gRPC health probe (grpc.health.v1) for any
//! Aliquot service, used by the compose file's health checks. Exit 0 when
//! the server (or `--service`) is SERVING, 1 otherwise, within `--timeout`.
//! Over mutual TLS like every client (`--role` names the server's role,
//! which its certificate must carry); `--insecure` for a plaintext server.

use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[derive(Clone, Debug, clap::Args)]
pub struct HealthArgs {
    /// The service's gRPC endpoint, e.g. 127.0.0.1:7000.
    pub url: String,
    /// The gRPC service to ask about; empty means the server as a whole.
    #[arg(long, default_value = "")]
    pub service: String,
    /// Give up (unhealthy) after this long.
    #[arg(long, default_value = "2s", value_parser = units::duration_arg)]
    pub timeout: Duration,
    /// The server's role: allocator, agent or metrics.
    #[arg(long, env = "ALIQUOT_HEALTH_ROLE", default_value = "allocator")]
    pub role: aliquot_auth::Role,
    #[command(flatten)]
    pub tls: aliquot_auth::ClientTlsArgs,
}

pub async fn run(args: HealthArgs) -> anyhow::Result<()> {
    let status = tokio::time::timeout(args.timeout, check(&args))
        .await
        .map_err(|_| {
            anyhow::anyhow!("{}: no health answer within {:?}", args.url, args.timeout)
        })??;
    if status == ServingStatus::Serving {
        println!("{}: SERVING", args.url);
        Ok(())
    } else {
        anyhow::bail!("{}: {}", args.url, status.as_str_name())
    }
}

async fn check(args: &HealthArgs) -> anyhow::Result<ServingStatus> {
    let channel = crate::client::channel(&args.tls.resolve()?, &args.url, args.role).await?;
    let reply = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: args.service.clone(),
        })
        .await
        .map_err(|s| crate::client::status_msg("health check", &s))?
        .into_inner();
    Ok(ServingStatus::try_from(reply.status).unwrap_or(ServingStatus::Unknown))
}
