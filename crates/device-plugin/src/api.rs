//! The kubelet device-plugin API v1beta1, generated at build time from `proto/api.proto`.

#[allow(clippy::all, missing_docs)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

pub use v1beta1::*;

/// The API version sent in RegisterRequest.
pub const VERSION: &str = "v1beta1";
/// kubelet's registration socket, in the device-plugins directory.
pub use crate::layout::KUBELET_SOCKET;
/// Device health values.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";

/// The largest gRPC message kubelet receives from a device plugin, in bytes (the 5-byte message
/// prefix not counted): 4 MiB. kubelet's device manager dials a plugin without raising the
/// receive limit (`dial` in kubernetes' pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go
/// passes no `grpc.MaxCallRecvMsgSize`), so grpc-go's default applies:
/// `defaultClientMaxReceiveMessageSize = 1024 * 1024 * 4` (grpc-go, clientconn.go/dialoptions.go).
/// A longer ListAndWatch response is refused by kubelet ("received message larger than max"),
/// and the resource is never advertised. (tonic's own client default is the same 4 MiB.)
pub const KUBELET_MAX_MESSAGE: usize = 4 * 1024 * 1024;
