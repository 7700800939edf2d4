//! Test support: a throwaway moto server (`moto_server`, PyPI `moto[server]`)
//! on a free loopback port, stopped when dropped.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use pgonce_sqs::{SqsClient, SqsConfig};

/// A running `moto_server` in its own process group, on 127.0.0.1 only.
pub struct Moto {
    child: Child,
    pub endpoint: String,
}

impl Moto {
    /// Starts moto and waits until it answers HTTP. Panics with a clear
    /// message when `moto_server` is not installed (scripts/ensure-moto.sh
    /// installs it; scripts/test sources that).
    pub fn start() -> Moto {
        let mut last = String::new();
        // A port picked free can be taken before moto binds it: try again.
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port")
                .port();
            let child = match std::os::unix::process::CommandExt::process_group(
                Command::new("moto_server")
                    .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
                0,
            )
            .spawn()
            {
                Ok(child) => child,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                    "moto_server is not installed: run `source scripts/ensure-moto.sh` \
                     (pip install 'moto[server]') or use scripts/test"
                ),
                Err(e) => panic!("cannot start moto_server: {e}"),
            };
            let mut moto = Moto {
                child,
                endpoint: format!("http://127.0.0.1:{port}"),
            };
            match moto.wait_ready(([127, 0, 0, 1], port).into()) {
                Ok(()) => return moto,
                Err(e) => last = e,
            }
        }
        panic!("moto_server did not come up: {last}");
    }

    /// Polls until moto answers an HTTP request (startup takes a second or
    /// two); fails early if the process exited.
    fn wait_ready(&mut self, addr: SocketAddr) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Err(format!("moto_server exited: {status}"));
            }
            if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let req = "GET /moto-api/ HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
                let mut buf = [0u8; 12];
                if s.write_all(req.as_bytes()).is_ok()
                    && s.read_exact(&mut buf).is_ok()
                    && buf.starts_with(b"HTTP/1.")
                {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err("no HTTP answer within 30 s".into())
    }

    pub async fn client(&self) -> SqsClient {
        SqsClient::connect(SqsConfig::local(&self.endpoint))
            .await
            .expect("SDK config")
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        // The whole process group: moto_server may fork helpers.
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = killpg(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = killpg(pid, Signal::SIGKILL);
        let _ = self.child.wait();
    }
}
