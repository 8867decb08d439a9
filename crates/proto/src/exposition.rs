//! The HTTP endpoint of a Prometheus text exposition, shared by the metadata server
//! (`--metrics-addr`), the agent (`-o metrics=`) and the CSI node (`sanfs-csi --metrics`).
//!
//! [`serve`] answers `GET` and `HEAD` of the paths it is given with `text/plain;
//! version=0.0.4; charset=utf-8` (the Prometheus text format), any other path with 404, and any
//! other method on a served path with 405 (`Allow: GET, HEAD`). HTTP/1.1 is hyper's
//! (`hyper::server::conn::http1`): keep-alive, pipelining and `Connection: close` work as any
//! client expects. Each connection is its own task, so a slow or broken client holds only
//! itself; a request head must arrive within [`HEADER_TIMEOUT`] (which also closes a kept-alive
//! connection left idle that long) and fit [`MAX_HEAD_BYTES`]; at most [`MAX_CONNECTIONS`]
//! connections are served at once, more wait to be accepted. A connection older than
//! [`MAX_CONNECTION_AGE`] is closed after its answer in progress (or dropped if that answer is
//! not taken within [`HEADER_TIMEOUT`]), so a client that stops reading holds its slot only so
//! long; a scraper simply connects again.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// The content type of every answer: the Prometheus text format.
pub const CONTENT_TYPE_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// How long a client may take to send a request head (and how long a kept-alive connection may
/// stay idle).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Most bytes of a request head buffered (hyper's smallest read buffer).
pub const MAX_HEAD_BYTES: usize = 8192;
/// Most connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// How long one connection is served (then closed between two answers).
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);

/// Makes a page's text at each request (on a blocking thread: rendering may take locks or ask
/// other processes).
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// What a served path answers.
#[derive(Clone)]
pub enum Page {
    /// Text made at each request by the function.
    Render(Render),
    /// A fixed text (a liveness probe's `ok`).
    Fixed(&'static str),
}

impl std::fmt::Debug for Page {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Page::Render(_) => f.write_str("Page::Render"),
            Page::Fixed(text) => f.debug_tuple("Page::Fixed").field(text).finish(),
        }
    }
}

/// The served paths (exact, a query string aside) and what each answers.
pub type Pages = Arc<[(&'static str, Page)]>;

/// Answers requests on `listener` with `pages` until the task is dropped.
pub async fn serve(listener: TcpListener, pages: Pages) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let pages = Arc::clone(&pages);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let pages = Arc::clone(&pages);
                async move { Ok::<_, Infallible>(answer(&req, &pages).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            let served = tokio::select! {
                served = conn.as_mut() => Some(served),
                () = tokio::time::sleep(MAX_CONNECTION_AGE) => {
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(HEADER_TIMEOUT, conn).await.ok()
                }
            };
            match served {
                Some(Ok(())) => {}
                Some(Err(e)) => tracing::debug!(%peer, error = %e, "metrics connection failed"),
                None => tracing::debug!(%peer, "metrics connection dropped: its answer not taken"),
            }
            drop(permit);
        });
    }
}

/// The answer to one request.
async fn answer(req: &Request<Incoming>, pages: &[(&'static str, Page)]) -> Response<Full<Bytes>> {
    let Some((_, page)) = pages.iter().find(|(path, _)| *path == req.uri().path()) else {
        let served: Vec<&str> = pages.iter().map(|(path, _)| *path).collect();
        let body = format!("not found: try GET {}\n", served.join(", GET "));
        return text(StatusCode::NOT_FOUND, body);
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: GET or HEAD\n".to_owned(),
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    // HEAD: the same head (its Content-Length too); hyper sends no body.
    match page {
        Page::Fixed(body) => text(StatusCode::OK, (*body).to_owned()),
        Page::Render(render) => {
            let render = Arc::clone(render);
            match tokio::task::spawn_blocking(move || render()).await {
                Ok(body) => text(StatusCode::OK, body),
                Err(e) => {
                    tracing::warn!(error = %e, "rendering the metrics failed");
                    text(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "rendering the metrics failed\n".to_owned(),
                    )
                }
            }
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE_TEXT));
    r
}
