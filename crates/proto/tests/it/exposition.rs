//! The metrics endpoints' HTTP (`sanfs_proto::exposition`) on a real TCP listener: keep-alive,
//! HEAD, 404 and 405, and a silent client that does not hold up the others.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sanfs_proto::exposition::{CONTENT_TYPE_TEXT, Page, Pages, serve};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// An endpoint serving `/metrics` (a counter of scrapes) and `/healthz`; its address.
async fn endpoint() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let scrapes = Arc::new(AtomicU64::new(0));
    let render = Arc::new(move || {
        let n = scrapes.fetch_add(1, Ordering::SeqCst) + 1;
        format!("# TYPE scrapes counter\nscrapes {n}\n")
    });
    let pages: Pages = Arc::new([
        ("/metrics", Page::Render(render)),
        ("/healthz", Page::Fixed("ok\n")),
    ]);
    tokio::spawn(serve(listener, pages));
    addr
}

/// One answer read off `r`: status line, headers (lower-case names), body.
async fn read_answer(
    r: &mut BufReader<TcpStream>,
    head_request: bool,
) -> (String, Vec<(String, String)>, String) {
    let mut status = String::new();
    r.read_line(&mut status).await.unwrap();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        r.read_line(&mut line).await.unwrap();
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (k, v) = line.split_once(':').unwrap();
        headers.push((k.to_ascii_lowercase(), v.trim().to_owned()));
    }
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map(|(_, v)| v.parse().unwrap())
        .unwrap();
    let mut body = vec![0; if head_request { 0 } else { len }];
    r.read_exact(&mut body).await.unwrap();
    (
        status.trim_end().to_owned(),
        headers,
        String::from_utf8(body).unwrap(),
    )
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[tokio::test]
async fn two_scrapes_on_one_kept_alive_connection() {
    let addr = endpoint().await;
    let mut r = BufReader::new(TcpStream::connect(addr).await.unwrap());
    for n in 1..=2 {
        r.get_mut()
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let (status, headers, body) = read_answer(&mut r, false).await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert_eq!(header(&headers, "content-type"), Some(CONTENT_TYPE_TEXT));
        assert!(body.ends_with(&format!("scrapes {n}\n")), "{body}");
    }
    // HEAD on the same connection: the head with the length, no body; then the liveness path.
    r.get_mut()
        .write_all(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (status, headers, _) = read_answer(&mut r, true).await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        header(&headers, "content-length")
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 0
    );
    let (status, _, body) = read_answer(&mut r, false).await;
    assert_eq!(
        (status.as_str(), body.as_str()),
        ("HTTP/1.1 200 OK", "ok\n")
    );
    // `Connection: close`: the answer, then the end of the stream.
    r.get_mut()
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let (status, _, body) = read_answer(&mut r, false).await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(body.ends_with("scrapes 4\n"), "{body}");
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
}

#[tokio::test]
async fn other_paths_are_404_and_other_methods_405() {
    let addr = endpoint().await;
    let mut r = BufReader::new(TcpStream::connect(addr).await.unwrap());
    r.get_mut()
        .write_all(b"GET /metricsx HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (status, headers, body) = read_answer(&mut r, false).await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    assert_eq!(header(&headers, "content-type"), Some(CONTENT_TYPE_TEXT));
    assert!(body.contains("GET /metrics"), "{body}");
    for method in ["POST", "PUT", "DELETE"] {
        r.get_mut()
            .write_all(
                format!("{method} /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .unwrap();
        let (status, headers, _) = read_answer(&mut r, false).await;
        assert_eq!(status, "HTTP/1.1 405 Method Not Allowed", "{method}");
        assert_eq!(header(&headers, "allow"), Some("GET, HEAD"));
    }
    // Nothing was rendered for them: the first scrape is the first.
    r.get_mut()
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (_, _, body) = read_answer(&mut r, false).await;
    assert!(body.ends_with("scrapes 1\n"), "{body}");
}

#[tokio::test]
async fn a_silent_client_does_not_hold_up_the_others_and_is_closed() {
    let addr = endpoint().await;
    // Half a request head, then nothing.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    silent.write_all(b"GET /metr").await.unwrap();
    let mut r = BufReader::new(TcpStream::connect(addr).await.unwrap());
    r.get_mut()
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(2), read_answer(&mut r, false))
        .await
        .expect("answered while another client is silent");
    assert_eq!(answered.0, "HTTP/1.1 200 OK");
    // The silent one is closed once its head is overdue (with an answer or without), and the
    // kept-alive one once it has been idle as long.
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), silent.read_to_end(&mut rest))
        .await
        .expect("the silent connection closed")
        .ok();
    let mut rest = Vec::new();
    let idle = tokio::time::timeout(Duration::from_secs(30), r.read_to_end(&mut rest))
        .await
        .expect("the idle kept-alive connection closed");
    assert!(idle.is_ok_and(|n| n == 0), "{rest:?}");
}

#[tokio::test]
async fn an_oversized_head_is_refused() {
    let addr = endpoint().await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let big = format!(
        "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(64 * 1024)
    );
    // The server may close before it has read everything: a write error is an answer too.
    let _ = s.write_all(big.as_bytes()).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .expect("the connection closed");
    let out = String::from_utf8_lossy(&out);
    assert!(!out.contains("200 OK"), "{out}");
}
