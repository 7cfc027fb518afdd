//! Compiles proto/api.proto (the kubelet device-plugin API) with protox, a pure-Rust protobuf
//! compiler, so that no system `protoc` is needed, and feeds the descriptors to tonic.

fn main() {
    println!("cargo:rerun-if-changed=proto/api.proto");
    let fds = protox::compile(["api.proto"], ["proto"]).unwrap_or_else(|e| {
        panic!("proto/api.proto: {e}");
    });
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)
        .unwrap_or_else(|e| panic!("generating the gRPC code for proto/api.proto: {e}"));
    podresources_build();
}

/// The second proto: kubelet's PodResources API v1 (the metrics' and cleanup's pod names).
fn podresources_build() {
    println!("cargo:rerun-if-changed=proto/podresources/api.proto");
    let fds = protox::compile(["api.proto"], ["proto/podresources"])
        .unwrap_or_else(|e| panic!("proto/podresources/api.proto: {e}"));
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)
        .unwrap_or_else(|e| panic!("generating the gRPC code for the PodResources API: {e}"));
}
