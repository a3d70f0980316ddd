//! gRPC calls over Rust's `h2` crate, the HTTP/2 of hyper and so of tonic (Rust's gRPC), for
//! tests/service/test_rust_h2.py. It speaks gRPC's framing and nothing of protobuf: the test encodes each
//! request message and decodes each answer with the project's own stubs, so the client stays a transport.
//!
//! Reads one JSON object on stdin:
//!
//!     {"address": "127.0.0.1:PORT", "window": 65535,
//!      "tls": {"ca": "ca.pem", "server_name": "localhost", "cert": "client.pem", "key": "client.key"},
//!      "rounds": [[{"path": "/pkg.Service/Method", "messages": ["<hex>", ...],
//!                   "metadata": [["name", "value"], ...], "copies": 1, "concurrency": 900}, ...], ...]}
//!
//! and, on one connection, makes each round's calls, each of its `copies` times, all at once (a stream
//! each; at most `concurrency` of a call's copies open at once, where given), then the next round's: a
//! round of one call first lets the server's SETTINGS arrive, whose limit of streams at once h2 keeps
//! (before them it knows none). A call sends its messages, each with gRPC's 5-byte prefix, then the end
//! of its stream. `window` is the client's initial stream window (hyper's default, 2 MiB, where absent).
//! With `tls` the connection is TLS with rustls, as tonic's is (`cert` and `key` for mutual TLS), and h2
//! must have been chosen by ALPN. Prints one JSON object:
//!
//!     {"alpn": "h2", "rounds": [[[{"status": 200, "headers": {...}, "messages": ["<hex>", ...],
//!                                  "trailers": {...}}, ...], ...], ...]}
//!
//! a list a round, in it a list a call, in that an answer a copy: `trailers` is null when the answer was
//! headers alone (gRPC's Trailers-Only), and a stream the server reset (REFUSED_STREAM, say) reads
//! `{"reset": <its code>}`. Then it closes the connection as hyper does and waits for it to end. Any other
//! HTTP/2 error (a GOAWAY, a frame the server sends wrong, the connection lost) ends the program with an
//! error.

use std::collections::BTreeMap;
use std::error::Error;
use std::fs::File;
use std::io::{BufReader, Read};
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use h2::client::SendRequest;
use http::{HeaderMap, Request};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_rustls::rustls::{Certificate, ClientConfig, PrivateKey, RootCertStore, ServerName};
use tokio_rustls::TlsConnector;

type Failure = Box<dyn Error + Send + Sync>;

fn header_map(headers: &HeaderMap) -> Value {
    let mut out: BTreeMap<String, Value> = BTreeMap::new();
    for (name, value) in headers {
        let text = String::from_utf8_lossy(value.as_bytes()).into_owned();
        out.insert(name.as_str().to_owned(), Value::String(text));
    }
    json!(out)
}

/// One gRPC message: its compressed flag (always 0 here), its length, then the message.
fn framed(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(0);
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// The messages of an answer's body, split at gRPC's prefixes.
fn messages(mut body: Bytes) -> Result<Vec<Value>, Failure> {
    let mut out = Vec::new();
    while body.has_remaining() {
        if body.remaining() < 5 {
            return Err("an answer's body ends inside a message's prefix".into());
        }
        let compressed = body.get_u8();
        let length = body.get_u32() as usize;
        if compressed != 0 {
            return Err("a compressed answer, which the client did not ask for".into());
        }
        if body.remaining() < length {
            return Err("an answer's body ends inside a message".into());
        }
        out.push(Value::String(hex::encode(body.split_to(length))));
    }
    Ok(out)
}

/// A call as the input names it: its path, its metadata, and its messages with gRPC's prefix.
struct Call {
    path: String,
    metadata: Vec<(String, String)>,
    body: Vec<Bytes>,
}

fn parse_call(spec: &Value) -> Result<Call, Failure> {
    let path = spec["path"].as_str().ok_or("a call without a path")?.to_owned();
    let mut body = Vec::new();
    for message in spec["messages"].as_array().cloned().unwrap_or_default() {
        body.push(framed(&hex::decode(
            message.as_str().ok_or("a message not in hex")?,
        )?));
    }
    let mut metadata = Vec::new();
    for pair in spec["metadata"].as_array().cloned().unwrap_or_default() {
        let name = pair[0].as_str().ok_or("metadata's name")?.to_owned();
        metadata.push((name, pair[1].as_str().ok_or("metadata's value")?.to_owned()));
    }
    Ok(Call { path, metadata, body })
}

/// One call; a stream the server reset (REFUSED_STREAM, say) is an answer too: `{"reset": <its code>}`.
async fn call(client: SendRequest<Bytes>, authority: &str, what: &Call) -> Result<Value, Failure> {
    match exchange(client, authority, what).await {
        Err(error) => match error.downcast_ref::<h2::Error>() {
            Some(e) if e.is_remote() && !e.is_go_away() && e.reason().is_some() => {
                Ok(json!({"reset": u32::from(e.reason().unwrap())}))
            }
            _ => Err(error),
        },
        answer => answer,
    }
}

async fn exchange(client: SendRequest<Bytes>, authority: &str, what: &Call) -> Result<Value, Failure> {
    let path = &what.path;
    let mut request = Request::builder()
        .method("POST")
        .uri(format!("http://{authority}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("user-agent", "mhaserve-test-h2/0.3");
    for (name, value) in &what.metadata {
        request = request.header(name.as_str(), value.as_str());
    }
    let mut client = client.ready().await?;
    let (response, mut send) = client.send_request(request.body(())?, false)?;
    let last = what.body.len();
    for (i, message) in what.body.iter().enumerate() {
        // h2 queues what the window does not take yet and sends it as the server credits it.
        send.send_data(message.clone(), i + 1 == last)?;
    }
    if last == 0 {
        send.send_data(Bytes::new(), true)?;
    }
    let response = response.await?;
    let (parts, mut stream) = response.into_parts();
    let ended = stream.is_end_stream();
    let mut received = BytesMut::new();
    while let Some(chunk) = stream.data().await {
        let chunk = chunk?;
        stream.flow_control().release_capacity(chunk.len())?;
        received.extend_from_slice(&chunk);
    }
    let trailers = if ended { None } else { stream.trailers().await? };
    Ok(json!({
        "status": parts.status.as_u16(),
        "headers": header_map(&parts.headers),
        "messages": messages(received.freeze())?,
        "trailers": trailers.as_ref().map(header_map),
    }))
}

/// tonic's TLS, rustls: the CA to trust, the name to check, and a certificate and key (PKCS#8) for
/// mutual TLS where given; ALPN offers h2 alone.
fn tls_config(tls: &Value) -> Result<ClientConfig, Failure> {
    let pem = |key: &str| -> Result<BufReader<File>, Failure> {
        Ok(BufReader::new(File::open(
            tls[key].as_str().ok_or("a TLS file not named")?,
        )?))
    };
    let mut roots = RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut pem("ca")?)? {
        roots.add(&Certificate(cert))?;
    }
    let builder = ClientConfig::builder()
        .with_safe_defaults()
        .with_root_certificates(roots);
    let mut config = if tls["cert"].is_string() {
        let chain = rustls_pemfile::certs(&mut pem("cert")?)?
            .into_iter()
            .map(Certificate)
            .collect();
        let key = rustls_pemfile::pkcs8_private_keys(&mut pem("key")?)?
            .pop()
            .ok_or("no PKCS#8 key")?;
        builder.with_single_cert(chain, PrivateKey(key))?
    } else {
        builder.with_no_client_auth()
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

async fn run(input: Value) -> Result<Value, Failure> {
    let address = input["address"].as_str().ok_or("no address")?.to_owned();
    let tcp = TcpStream::connect(&address).await?;
    tcp.set_nodelay(true)?;
    if input["tls"].is_null() {
        return calls(tcp, &input, None).await;
    }
    let config = Arc::new(tls_config(&input["tls"])?);
    let name = ServerName::try_from(input["tls"]["server_name"].as_str().unwrap_or("localhost"))?;
    let tls = TlsConnector::from(config).connect(name, tcp).await?;
    // As tonic does: HTTP/2 over TLS only where the server chose it by ALPN.
    let alpn = tls
        .get_ref()
        .1
        .alpn_protocol()
        .map(|p| String::from_utf8_lossy(p).into_owned());
    if alpn.as_deref() != Some("h2") {
        return Err(format!("the server chose {alpn:?} by ALPN, not h2").into());
    }
    calls(tls, &input, alpn).await
}

async fn calls<T>(io: T, input: &Value, alpn: Option<String>) -> Result<Value, Failure>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let address = input["address"].as_str().ok_or("no address")?.to_owned();
    let window = input["window"].as_u64().unwrap_or(2 * 1024 * 1024) as u32;
    // hyper's defaults for a client (its http2 module): a 2 MiB stream window, 5 MiB for the connection.
    let (client, connection) = h2::client::Builder::new()
        .initial_window_size(window)
        .initial_connection_window_size(5 * 1024 * 1024)
        .handshake::<_, Bytes>(io)
        .await?;
    // The connection makes progress only while polled: it runs as a task of its own beside the calls.
    let connection = tokio::spawn(connection);
    let mut rounds = Vec::new();
    for round in input["rounds"].as_array().ok_or("no rounds")? {
        let mut tasks = Vec::new();
        for spec in round.as_array().ok_or("a round that is not a list of calls")? {
            let what = Arc::new(parse_call(spec)?);
            // `concurrency`: at most this many of the copies open at once (tonic's
            // Endpoint::concurrency_limit); without it, as many as the server's limit of streams lets h2 open.
            let open = spec["concurrency"]
                .as_u64()
                .map_or(Semaphore::MAX_PERMITS, |n| n as usize);
            let open = Arc::new(Semaphore::new(open));
            let mut answers = Vec::new();
            for _ in 0..spec["copies"].as_u64().unwrap_or(1) {
                let (client, address, what, open) =
                    (client.clone(), address.clone(), what.clone(), open.clone());
                answers.push(tokio::spawn(async move {
                    let _turn = open.acquire_owned().await?;
                    call(client, &address, &what).await
                }));
            }
            tasks.push(answers);
        }
        let mut calls = Vec::new();
        for answers in tasks {
            let mut copies = Vec::new();
            for answer in answers {
                copies.push(answer.await??);
            }
            calls.push(Value::Array(copies));
        }
        rounds.push(Value::Array(calls));
    }
    // As hyper does when its last handle goes: with no stream left and no handle, the connection sends a
    // GOAWAY (NO_ERROR) and ends; an error the server caused surfaces here.
    drop(client);
    connection.await??;
    Ok(json!({"rounds": rounds, "alpn": alpn}))
}

fn main() -> Result<(), Failure> {
    let mut text = String::new();
    std::io::stdin().read_to_string(&mut text)?;
    let input: Value = serde_json::from_str(&text)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let out = runtime.block_on(run(input))?;
    println!("{out}");
    Ok(())
}
