//! A fake of kubelet's PodResources service (v1 `List`), written from upstream's API
//! (kubernetes/kubelet `pkg/apis/podresources/v1/api.proto`): answers with what the test says
//! runs, and can go away and come back as a restarting kubelet does.

use cuvisor_device_plugin::podresources::v1;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};

/// A running pod: name, resource, device IDs.
pub type Pod = (String, String, Vec<String>);

#[derive(Clone, Default)]
pub struct FakePods(Arc<Mutex<Vec<Pod>>>);

impl FakePods {
    /// Serves on `sock` (in the current tokio runtime) until the handle is aborted or the
    /// runtime ends.
    pub fn serve(&self, sock: &Path) -> tokio::task::JoinHandle<()> {
        let l = tokio::net::UnixListener::bind(sock).unwrap();
        let svc = v1::pod_resources_lister_server::PodResourcesListerServer::new(self.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l))
                .await
                .unwrap();
        })
    }

    /// Pod `pod` (namespace "ml", container "main") holds `ids` of `resource`.
    pub fn run(&self, pod: &str, resource: &str, ids: &[String]) {
        self.0
            .lock()
            .unwrap()
            .push((pod.into(), resource.into(), ids.to_vec()));
    }

    pub fn end(&self, pod: &str) {
        self.0.lock().unwrap().retain(|(p, _, _)| p != pod);
    }
}

#[tonic::async_trait]
impl v1::pod_resources_lister_server::PodResourcesLister for FakePods {
    async fn list(
        &self,
        _: Request<v1::ListPodResourcesRequest>,
    ) -> Result<Response<v1::ListPodResourcesResponse>, Status> {
        let pods = self.0.lock().unwrap().clone();
        Ok(Response::new(v1::ListPodResourcesResponse {
            pod_resources: pods
                .into_iter()
                .map(|(pod, resource, ids)| v1::PodResources {
                    name: pod,
                    namespace: "ml".into(),
                    containers: vec![v1::ContainerResources {
                        name: "main".into(),
                        devices: vec![v1::ContainerDevices {
                            resource_name: resource,
                            device_ids: ids,
                            topology: None,
                        }],
                        ..Default::default()
                    }],
                })
                .collect(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<v1::AllocatableResourcesRequest>,
    ) -> Result<Response<v1::AllocatableResourcesResponse>, Status> {
        Ok(Response::new(Default::default()))
    }

    async fn get(
        &self,
        _: Request<v1::GetPodResourcesRequest>,
    ) -> Result<Response<v1::GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }
}
