//! [`FenceGate`]: no answer from a deposed leader. Every service of an HA leader sits behind
//! it: a request that arrives, or an answer that is ready, after the leader's fence is lost
//! or past its deadline is answered `UNAVAILABLE` instead (the client tries the other
//! servers). So a leader that was paused and wakes up does not hand out what it read from its
//! store before the pause (attributes, names, extents a new leader may have changed since):
//! the writes are refused by the LUNs' checks (`store::device`, `datadev`), the reads here.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::codegen::http;

use crate::store::fence::Fence;

/// See the module doc. Without a fence (no `[ha]`) it passes everything through.
#[derive(Debug, Clone)]
pub struct FenceGate<S> {
    inner: S,
    fence: Option<Arc<Fence>>,
}

impl<S> FenceGate<S> {
    pub fn new(inner: S, fence: Option<Arc<Fence>>) -> FenceGate<S> {
        FenceGate { inner, fence }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for FenceGate<S> {
    const NAME: &'static str = S::NAME;
}

fn refused<B: Default>(fence: &Fence) -> http::Response<B> {
    let why = fence
        .check()
        .err()
        .map_or_else(|| "fenced".to_owned(), |e| e.to_string());
    tonic::Status::unavailable(format!("not the leader any more: {why}")).into_http()
}

impl<S, Req, B> tower::Service<Req> for FenceGate<S>
where
    S: tower::Service<Req, Response = http::Response<B>>,
    S::Future: Send + 'static,
    B: Default + Send + 'static,
{
    type Response = http::Response<B>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let fence = self.fence.clone();
        if let Some(f) = fence.as_ref().filter(|f| f.check().is_err()) {
            let answer = refused(f);
            return Box::pin(async move { Ok(answer) });
        }
        let answering = self.inner.call(request);
        Box::pin(async move {
            let answer = answering.await?;
            match &fence {
                Some(f) if f.check().is_err() => Ok(refused(f)),
                _ => Ok(answer),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};
    use tower::Service;

    #[derive(Clone)]
    struct Answer;

    impl tower::Service<()> for Answer {
        type Response = http::Response<String>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<http::Response<String>, std::convert::Infallible>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, (): ()) -> Self::Future {
            std::future::ready(Ok(http::Response::new("answer".to_owned())))
        }
    }

    fn grpc_status(r: &http::Response<String>) -> Option<&str> {
        r.headers().get("grpc-status").and_then(|v| v.to_str().ok())
    }

    #[tokio::test]
    async fn a_leader_answers_while_its_fence_holds_and_never_after() {
        let fence = Arc::new(Fence::new(3, Instant::now() + Duration::from_secs(60)));
        let mut gate = FenceGate::new(Answer, Some(fence.clone()));
        let ok = gate.call(()).await.unwrap();
        assert_eq!(ok.body(), "answer");
        assert_eq!(grpc_status(&ok), None);
        fence.lose("a newer leader");
        let refused = gate.call(()).await.unwrap();
        assert_eq!(grpc_status(&refused), Some("14"), "UNAVAILABLE");
        let mut open = FenceGate::new(Answer, None);
        assert_eq!(open.call(()).await.unwrap().body(), "answer");
    }
}
