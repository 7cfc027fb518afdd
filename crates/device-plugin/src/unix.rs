//! A gRPC channel over a Unix socket: how the plugin reaches kubelet (Registration,
//! PodResources) and how tests reach the plugin.

use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// How long a connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A gRPC channel over the Unix socket at `path`.
pub async fn connect_unix(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    // The URI is never dialled (the connector below is); h2 needs one.
    Endpoint::try_from("http://[::1]:50051")?
        .connect_timeout(CONNECT_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(UnixStream::connect(p).await?))
            }
        }))
        .await
}
