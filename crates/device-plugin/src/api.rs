//! The kubelet device-plugin API v1beta1, generated at build time from `proto/api.proto`.

#[allow(clippy::all, missing_docs)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

pub use v1beta1::*;

/// The API version sent in RegisterRequest.
pub const VERSION: &str = "v1beta1";
/// kubelet's registration socket, in the device-plugins directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Device health values.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";
