//! The role check, once, at the gRPC edge: a tower layer in front of every
//! service of a server. It reads the identity from the client certificate
//! the TLS handshake verified, refuses calls the [`policy`](crate::policy)
//! table does not allow for that role, and hands the [`Identity`] to the
//! handlers in the request extensions (`request.extensions().get::<Identity>()`).
//!
//! Refusals: UNAUTHENTICATED (reason `CERTIFICATE_REQUIRED`) without a usable
//! pool certificate, PERMISSION_DENIED (reason `ROLE_NOT_ALLOWED`, metadata
//! `method`, `role`, `allowed`) when the role may not call the method.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use aliquot_proto::error::Refusal;
use aliquot_proto::v1::ErrorReason;
use tonic::codegen::Service;
use tonic::codegen::http;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::{Code, Status};
use tower::Layer;

use crate::policy;
use crate::role::{Identity, Role};

/// Enforcing, or (for an explicitly `--insecure` plaintext server) a
/// pass-through, so both kinds of server have the same type.
#[derive(Clone, Copy, Debug)]
pub struct RoleLayer {
    enforce: bool,
}

impl RoleLayer {
    pub fn enforce() -> RoleLayer {
        RoleLayer { enforce: true }
    }

    /// No checks, no identities: plaintext servers only.
    pub fn insecure() -> RoleLayer {
        RoleLayer { enforce: false }
    }
}

impl<S> Layer<S> for RoleLayer {
    type Service = RoleCheck<S>;
    fn layer(&self, inner: S) -> RoleCheck<S> {
        RoleCheck {
            inner,
            enforce: self.enforce,
        }
    }
}

#[derive(Clone, Debug)]
pub struct RoleCheck<S> {
    inner: S,
    enforce: bool,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> Service<http::Request<B>> for RoleCheck<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if !self.enforce {
            return Box::pin(self.inner.call(req));
        }
        // Our listener's (crate::listen) or, for a server on tonic's own
        // TLS, tonic's.
        let ours = req
            .extensions()
            .get::<crate::listen::PeerInfo>()
            .and_then(|i| i.certs.clone());
        let tonics = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|i| i.peer_certs());
        let leaf = match (&ours, &tonics) {
            (Some(c), _) => c.first().map(|c| c.as_ref()),
            (None, Some(c)) => c.first().map(|c| c.as_ref()),
            (None, None) => None,
        };
        match authorize(req.uri().path(), leaf) {
            Ok(id) => {
                req.extensions_mut().insert(id);
                Box::pin(self.inner.call(req))
            }
            Err(status) => {
                tracing::warn!(method = req.uri().path(), code = ?status.code(), message = status.message(), "call refused");
                let resp = status.into_http::<R>();
                Box::pin(std::future::ready(Ok(resp)))
            }
        }
    }
}

/// The decision, apart from the transport: `leaf_der` is the peer's verified
/// leaf certificate, if any.
pub fn authorize(path: &str, leaf_der: Option<&[u8]>) -> Result<Identity, Status> {
    let Some(der) = leaf_der else {
        return Err(refuse(
            Code::Unauthenticated,
            ErrorReason::CertificateRequired,
            format!("{path} needs a client certificate from the pool CA (mutual TLS)"),
            path,
            None,
        ));
    };
    let Some(id) = Identity::from_cert_der(der) else {
        return Err(refuse(
            Code::Unauthenticated,
            ErrorReason::CertificateRequired,
            format!(
                "{path}: the client certificate names no Aliquot role (issue one with `aliquotctl certs issue`)"
            ),
            path,
            None,
        ));
    };
    let allowed = policy::allowed(path).unwrap_or(&[]);
    if allowed.contains(&id.role) {
        return Ok(id);
    }
    let need = if allowed.is_empty() {
        "no role".to_owned()
    } else {
        allowed
            .iter()
            .map(|r| r.as_str())
            .collect::<Vec<_>>()
            .join(" or ")
    };
    Err(refuse(
        Code::PermissionDenied,
        ErrorReason::RoleNotAllowed,
        format!(
            "{path} needs role {need}; the caller {id} has role {}",
            id.role
        ),
        path,
        Some((id.role, allowed)),
    ))
}

fn refuse(
    code: Code,
    reason: ErrorReason,
    message: String,
    path: &str,
    role: Option<(Role, &[Role])>,
) -> Status {
    let mut r = Refusal::new(code, reason).with("method", path);
    if let Some((have, allowed)) = role {
        r = r.with("role", have).with(
            "allowed",
            allowed
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    r.status(message)
}
