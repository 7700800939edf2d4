//! A TCP proxy in front of a PostgreSQL server that misbehaves the way a
//! network, a distant server or a slow login does, on the test's say:
//! new connections forwarded at once, late, or only once the test takes
//! them (or refuses them), and the server's answer to a chosen client
//! message held back until the test releases it.
//!
//! The proxy relays bytes and reads none of the protocol: it sees what
//! each side sent one read at a time, as it arrives. Dropping it stops it
//! whole: its port refuses new connections, and every connection through
//! it is closed, held or forwarded.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// What the proxy does with each new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NewConnections {
    /// Forwarded to the server at once.
    Forward,
    /// Forwarded to the server this late: nothing the client sends reaches
    /// the server before, so its login is answered at least this late.
    /// Each connection waits on its own, not behind the one before.
    ForwardLate(Duration),
    /// Held, forwarding nothing, and handed to the test in the order they
    /// came by [`FaultProxy::next_connection`], to forward or refuse. One
    /// the test does not take stays held (its client's connect waits on)
    /// until the proxy is dropped.
    HandOver,
}

/// A TCP proxy on a loopback port in front of a PostgreSQL server; see
/// the [module documentation](self). It runs on the tokio runtime it was
/// started on, and stops when dropped.
pub struct FaultProxy {
    options: PgConnectOptions,
    address: SocketAddr,
    handed_over: Option<mpsc::UnboundedReceiver<HeldConnection>>,
    relaying: Relaying,
    _stop: watch::Sender<()>,
}

impl FaultProxy {
    /// Starts a proxy on 127.0.0.1 at a free port in front of the server
    /// `server` names (by TCP host and port), doing with each new
    /// connection what `new` says.
    pub async fn start(
        server: PgConnectOptions,
        new: NewConnections,
    ) -> Result<FaultProxy, std::io::Error> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let address = listener.local_addr()?;
        let (stop, stopped) = watch::channel(());
        let relaying = Relaying {
            server: (server.get_host().to_string(), server.get_port()),
            armed: Arc::default(),
            stopped,
        };
        let (hand_over, handed_over) = match new {
            NewConnections::HandOver => {
                let (tx, rx) = mpsc::unbounded_channel();
                (Some(tx), Some(rx))
            }
            NewConnections::Forward | NewConnections::ForwardLate(_) => (None, None),
        };
        let late = match new {
            NewConnections::ForwardLate(late) => late,
            NewConnections::Forward | NewConnections::HandOver => Duration::ZERO,
        };
        let accepting = relaying.clone();
        tokio::spawn(async move {
            let mut stopped = accepting.stopped.clone();
            loop {
                let client = tokio::select! {
                    biased;
                    _ = stopped.changed() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => return,
                    },
                };
                match &hand_over {
                    Some(hand_over) => {
                        let held = HeldConnection {
                            client,
                            relaying: accepting.clone(),
                        };
                        if hand_over.send(held).is_err() {
                            return;
                        }
                    }
                    None => {
                        tokio::spawn(accepting.clone().relay(client, late));
                    }
                }
            }
        });
        Ok(FaultProxy {
            options: server.host("127.0.0.1").port(address.port()),
            address,
            handed_over,
            relaying,
            _stop: stop,
        })
    }

    /// Connection options that reach the server through the proxy: the
    /// server's, with the proxy's host and port.
    pub fn options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// The proxy's address (127.0.0.1 and its port), for a client
    /// configured by URL.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The next new connection, held until the test forwards or refuses
    /// it; waits for one to come.
    ///
    /// # Panics
    ///
    /// When the proxy was not started with [`NewConnections::HandOver`].
    pub async fn next_connection(&mut self) -> HeldConnection {
        let handed_over = self
            .handed_over
            .as_mut()
            .expect("a proxy started with NewConnections::HandOver");
        handed_over
            .recv()
            .await
            .expect("the proxy accepts connections as long as it lives")
    }

    /// Holds back the server's answer on the next connection whose client
    /// sends bytes that `sent` matches (one read's worth, as it arrived):
    /// those bytes go through, and what the server sends on that
    /// connection from then on is held until the returned [`HeldAnswer`]
    /// is released or dropped. Applies once, to one connection, forwarded
    /// already or later; replaces a hold armed earlier that nothing has
    /// matched yet.
    pub fn hold_answer_to(&self, sent: impl Fn(&[u8]) -> bool + Send + 'static) -> HeldAnswer {
        let (release, released) = watch::channel(false);
        *self.relaying.armed.lock().expect("not poisoned") = Some(ArmedHold {
            sent: Box::new(sent),
            released,
        });
        HeldAnswer { release }
    }
}

/// A new connection the proxy holds, forwarding nothing, until the test
/// forwards or refuses it. Dropped, its connection is closed.
pub struct HeldConnection {
    client: TcpStream,
    relaying: Relaying,
}

impl HeldConnection {
    /// Relays the connection to the server from now on.
    pub fn forward(self) -> Forwarded {
        let relay = tokio::spawn(self.relaying.relay(self.client, Duration::ZERO));
        Forwarded { relay }
    }

    /// Closes the connection before a byte went through: the client's
    /// connect fails at once (closed by the other end, not refused, which
    /// a pool would retry).
    pub fn refuse(self) {
        drop(self.client);
    }
}

/// A connection [`HeldConnection::forward`] relays.
pub struct Forwarded {
    relay: JoinHandle<()>,
}

impl Forwarded {
    /// Whether the relay has ended: both sides closed their end (or one
    /// failed), or the proxy was dropped.
    pub fn has_ended(&self) -> bool {
        self.relay.is_finished()
    }
}

/// The server's answer held back by [`FaultProxy::hold_answer_to`] on the
/// connection it applies to. Dropping it releases the answer too.
pub struct HeldAnswer {
    release: watch::Sender<bool>,
}

impl HeldAnswer {
    /// Lets what the server sent, and sends from now on, through.
    pub fn release(self) {
        self.release.send_replace(true);
    }
}

/// Which bytes from a client a hold of the server's answer applies to.
type SentMatcher = Box<dyn Fn(&[u8]) -> bool + Send>;

/// A hold of the server's answer, armed and not yet matched.
struct ArmedHold {
    sent: SentMatcher,
    released: watch::Receiver<bool>,
}

/// What every relay of one proxy shares.
#[derive(Clone)]
struct Relaying {
    server: (String, u16),
    armed: Arc<Mutex<Option<ArmedHold>>>,
    /// Changes (its sender dropped) when the proxy is dropped.
    stopped: watch::Receiver<()>,
}

impl Relaying {
    /// Connects to the server `late` and relays `client` both ways, until
    /// both sides have closed their end or the proxy is dropped. A server
    /// that cannot be reached closes the client.
    async fn relay(self, client: TcpStream, late: Duration) {
        let mut stopped = self.stopped.clone();
        let relaying = async {
            tokio::time::sleep(late).await;
            if let Ok(server) = TcpStream::connect(&self.server).await {
                self.both_ways(client, server).await;
            }
        };
        tokio::select! {
            biased;
            _ = stopped.changed() => {}
            () = relaying => {}
        }
    }

    /// Copies what each side sends to the other; a side that closes its
    /// end (or fails to read) has the other's write end shut down.
    async fn both_ways(&self, client: TcpStream, server: TcpStream) {
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        // The hold this connection's client matched, if it did.
        let (hold, mut held) = watch::channel(None::<watch::Receiver<bool>>);
        let upstream = async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = client_read.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    let _ = server_write.shutdown().await;
                    return;
                }
                if let Some(released) = self.matched_hold(&buf[..n]) {
                    hold.send_replace(Some(released));
                }
                if server_write.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        let downstream = async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = server_read.read(&mut buf).await.unwrap_or(0);
                let released = held.borrow_and_update().clone();
                if let Some(mut released) = released {
                    // An error: the `HeldAnswer` was dropped, which
                    // releases it too.
                    let _ = released.wait_for(|released| *released).await;
                }
                if n == 0 {
                    let _ = client_write.shutdown().await;
                    return;
                }
                if client_write.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        tokio::join!(upstream, downstream);
    }

    /// Takes the armed hold when the client's `sent` bytes match it.
    fn matched_hold(&self, sent: &[u8]) -> Option<watch::Receiver<bool>> {
        let mut armed = self.armed.lock().expect("not poisoned");
        match armed.as_ref() {
            Some(hold) if (hold.sent)(sent) => armed.take().map(|hold| hold.released),
            _ => None,
        }
    }
}
