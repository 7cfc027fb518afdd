//! Entry points of the real NVML that the simulator does not model. They exist, so loaders that
//! resolve every symbol up front work, and answer NVML_ERROR_NOT_SUPPORTED: what a real driver
//! says for a feature the GPU lacks, which every NVML client handles. The list is every function
//! nvml-wrapper 0.13 can call that is not implemented elsewhere in this crate, plus the old
//! unversioned forms whose structs differ from today's (`nvmlDeviceGetPciInfo`,
//! `nvmlDeviceGetNvLinkRemotePciInfo`: a caller compiled against them has a smaller buffer) and a
//! few queries nvidia-smi-like tools and the NVIDIA device plugin make.

use cuvisor_cuda_abi::nvml::{nvmlReturn_t, ret};

/// The C calling convention lets a no-argument function stand in for any signature: the caller
/// cleans up its arguments. Nothing here reads them, so there is nothing that can fail.
macro_rules! not_supported {
    ($($name:ident)*) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> nvmlReturn_t {
            ret::ERROR_NOT_SUPPORTED
        }
    )*};
}

not_supported! {
    nvmlDeviceClearAccountingPids nvmlDeviceClearCpuAffinity nvmlDeviceClearEccErrorCounts
    nvmlDeviceClearFieldValues nvmlDeviceDiscoverGpus nvmlDeviceFreezeNvLinkUtilizationCounter
    nvmlDeviceGetAPIRestriction nvmlDeviceGetAccountingBufferSize nvmlDeviceGetAccountingMode
    nvmlDeviceGetAccountingPids nvmlDeviceGetAccountingStats nvmlDeviceGetActiveVgpus
    nvmlDeviceGetAdaptiveClockInfoStatus nvmlDeviceGetApplicationsClock nvmlDeviceGetAttributes_v2
    nvmlDeviceGetAutoBoostedClocksEnabled nvmlDeviceGetBAR1MemoryInfo nvmlDeviceGetBoardPartNumber
    nvmlDeviceGetBrand nvmlDeviceGetBridgeChipInfo nvmlDeviceGetBusType nvmlDeviceGetC2cModeInfoV
    nvmlDeviceGetClock nvmlDeviceGetClockInfo nvmlDeviceGetClockOffsets
    nvmlDeviceGetComputeInstanceId nvmlDeviceGetConfComputeGpuAttestationReport
    nvmlDeviceGetConfComputeGpuCertificate nvmlDeviceGetConfComputeMemSizeInfo
    nvmlDeviceGetConfComputeProtectedMemoryUsage nvmlDeviceGetCreatableVgpus
    nvmlDeviceGetCurrPcieLinkGeneration nvmlDeviceGetCurrPcieLinkWidth
    nvmlDeviceGetCurrentClocksEventReasons nvmlDeviceGetCurrentClocksThrottleReasons
    nvmlDeviceGetDecoderUtilization nvmlDeviceGetDefaultApplicationsClock
    nvmlDeviceGetDefaultEccMode nvmlDeviceGetDetailedEccErrors
    nvmlDeviceGetDeviceHandleFromMigDeviceHandle nvmlDeviceGetDisplayActive
    nvmlDeviceGetDisplayMode nvmlDeviceGetDriverModel nvmlDeviceGetEccMode
    nvmlDeviceGetEncoderCapacity nvmlDeviceGetEncoderSessions nvmlDeviceGetEncoderStats
    nvmlDeviceGetEncoderUtilization nvmlDeviceGetFBCSessions nvmlDeviceGetFBCStats
    nvmlDeviceGetFanControlPolicy_v2 nvmlDeviceGetFanSpeed nvmlDeviceGetFanSpeedRPM
    nvmlDeviceGetFanSpeed_v2 nvmlDeviceGetFieldValues nvmlDeviceGetGpcClkVfOffset
    nvmlDeviceGetGpuFabricInfo nvmlDeviceGetGpuFabricInfoV nvmlDeviceGetGpuInstanceId
    nvmlDeviceGetGpuInstancePossiblePlacements_v2 nvmlDeviceGetGpuInstanceProfileInfo
    nvmlDeviceGetGpuInstanceProfileInfoV nvmlDeviceGetGpuInstances nvmlDeviceGetGpuOperationMode
    nvmlDeviceGetGridLicensableFeatures_v4 nvmlDeviceGetGspFirmwareMode
    nvmlDeviceGetGspFirmwareVersion nvmlDeviceGetHandleBySerial nvmlDeviceGetHostVgpuMode
    nvmlDeviceGetInforomConfigurationChecksum nvmlDeviceGetInforomImageVersion
    nvmlDeviceGetInforomVersion nvmlDeviceGetIrqNum nvmlDeviceGetJpgUtilization
    nvmlDeviceGetMaxCustomerBoostClock nvmlDeviceGetMaxMigDeviceCount
    nvmlDeviceGetMaxPcieLinkGeneration nvmlDeviceGetMaxPcieLinkWidth nvmlDeviceGetMemClkVfOffset
    nvmlDeviceGetMemoryErrorCounter nvmlDeviceGetMigDeviceHandleByIndex
    nvmlDeviceGetMinMaxClockOfPState nvmlDeviceGetMinMaxFanSpeed nvmlDeviceGetModuleId
    nvmlDeviceGetNumFans nvmlDeviceGetNumGpuCores nvmlDeviceGetNvLinkErrorCounter
    nvmlDeviceGetNvLinkInfo nvmlDeviceGetNvLinkRemotePciInfo nvmlDeviceGetNvLinkUtilizationControl
    nvmlDeviceGetNvLinkUtilizationCounter nvmlDeviceGetNvlinkBwMode
    nvmlDeviceGetNvlinkSupportedBwModes nvmlDeviceGetOfaUtilization nvmlDeviceGetPciInfo
    nvmlDeviceGetPcieLinkMaxSpeed nvmlDeviceGetPcieReplayCounter nvmlDeviceGetPcieSpeed
    nvmlDeviceGetPcieThroughput nvmlDeviceGetPerformanceModes nvmlDeviceGetPerformanceState
    nvmlDeviceGetPersistenceMode nvmlDeviceGetPowerManagementLimitConstraints
    nvmlDeviceGetPowerManagementMode nvmlDeviceGetPowerMizerMode_v1 nvmlDeviceGetPowerSource
    nvmlDeviceGetPowerState nvmlDeviceGetRemappedRows nvmlDeviceGetRetiredPages
    nvmlDeviceGetRetiredPagesPendingStatus nvmlDeviceGetRetiredPages_v2
    nvmlDeviceGetRowRemapperHistogram nvmlDeviceGetRunningProcessDetailList nvmlDeviceGetSamples
    nvmlDeviceGetSupportedClocksEventReasons nvmlDeviceGetSupportedClocksThrottleReasons
    nvmlDeviceGetSupportedGraphicsClocks nvmlDeviceGetSupportedMemoryClocks
    nvmlDeviceGetSupportedPerformanceStates nvmlDeviceGetSupportedVgpus
    nvmlDeviceGetTemperatureThreshold nvmlDeviceGetTotalEccErrors nvmlDeviceGetVbiosVersion
    nvmlDeviceGetVgpuCapabilities nvmlDeviceGetVgpuMetadata nvmlDeviceGetVgpuSchedulerCapabilities
    nvmlDeviceGetVgpuSchedulerLog nvmlDeviceGetVgpuSchedulerState nvmlDeviceGetViolationStatus
    nvmlDeviceGetVirtualizationMode nvmlDeviceModifyDrainState nvmlDeviceQueryDrainState
    nvmlDeviceRemoveGpu_v2 nvmlDeviceResetApplicationsClocks nvmlDeviceResetGpuLockedClocks
    nvmlDeviceResetMemoryLockedClocks nvmlDeviceResetNvLinkErrorCounters
    nvmlDeviceResetNvLinkUtilizationCounter nvmlDeviceSetAPIRestriction nvmlDeviceSetAccountingMode
    nvmlDeviceSetApplicationsClocks nvmlDeviceSetAutoBoostedClocksEnabled nvmlDeviceSetClockOffsets
    nvmlDeviceSetComputeMode nvmlDeviceSetCpuAffinity nvmlDeviceSetDefaultAutoBoostedClocksEnabled
    nvmlDeviceSetDefaultFanSpeed_v2 nvmlDeviceSetDriverModel nvmlDeviceSetEccMode
    nvmlDeviceSetFanControlPolicy nvmlDeviceSetFanSpeed_v2 nvmlDeviceSetGpcClkVfOffset
    nvmlDeviceSetGpuLockedClocks nvmlDeviceSetGpuOperationMode nvmlDeviceSetMemClkVfOffset
    nvmlDeviceSetMemoryLockedClocks nvmlDeviceSetMigMode nvmlDeviceSetNvLinkUtilizationControl
    nvmlDeviceSetPersistenceMode nvmlDeviceSetPowerManagementLimit nvmlDeviceSetPowerMizerMode_v1
    nvmlDeviceSetTemperatureThreshold nvmlDeviceSetVgpuCapabilities nvmlDeviceSetVgpuSchedulerState
    nvmlDeviceValidateInforom nvmlGetExcludedDeviceCount nvmlGetExcludedDeviceInfoByIndex
    nvmlGetVgpuDriverCapabilities nvmlGetVgpuVersion nvmlGpmMetricsGet nvmlGpmMigSampleGet
    nvmlGpmQueryDeviceSupport nvmlGpmQueryIfStreamingEnabled nvmlGpmSampleAlloc nvmlGpmSampleFree
    nvmlGpmSampleGet nvmlGpmSetStreamingEnabled nvmlSetVgpuVersion
    nvmlSystemGetConfComputeCapabilities nvmlSystemGetConfComputeGpusReadyState
    nvmlSystemGetConfComputeSettings nvmlSystemGetConfComputeState nvmlSystemGetHicVersion
    nvmlSystemGetNvlinkBwMode nvmlSystemSetConfComputeGpusReadyState nvmlSystemSetNvlinkBwMode
    nvmlUnitGetCount nvmlUnitGetDevices nvmlUnitGetFanSpeedInfo nvmlUnitGetHandleByIndex
    nvmlUnitGetLedState nvmlUnitGetPsuInfo nvmlUnitGetTemperature nvmlUnitGetUnitInfo
    nvmlUnitSetLedState nvmlVgpuInstanceClearAccountingPids nvmlVgpuInstanceGetAccountingMode
    nvmlVgpuInstanceGetAccountingPids nvmlVgpuInstanceGetAccountingStats nvmlVgpuInstanceGetEccMode
    nvmlVgpuInstanceGetEncoderCapacity nvmlVgpuInstanceGetEncoderSessions
    nvmlVgpuInstanceGetEncoderStats nvmlVgpuInstanceGetFBCSessions nvmlVgpuInstanceGetFBCStats
    nvmlVgpuInstanceGetFbUsage nvmlVgpuInstanceGetFrameRateLimit nvmlVgpuInstanceGetGpuInstanceId
    nvmlVgpuInstanceGetGpuPciId nvmlVgpuInstanceGetLicenseInfo nvmlVgpuInstanceGetLicenseInfo_v2
    nvmlVgpuInstanceGetMdevUUID nvmlVgpuInstanceGetMetadata nvmlVgpuInstanceGetPlacementId
    nvmlVgpuInstanceGetRuntimeStateSize nvmlVgpuInstanceGetType nvmlVgpuInstanceGetUUID
    nvmlVgpuInstanceGetVmDriverVersion nvmlVgpuInstanceGetVmID nvmlVgpuInstanceSetEncoderCapacity
    nvmlVgpuTypeGetBAR1Info nvmlVgpuTypeGetCapabilities nvmlVgpuTypeGetClass
    nvmlVgpuTypeGetDeviceID nvmlVgpuTypeGetFbReservation nvmlVgpuTypeGetFrameRateLimit
    nvmlVgpuTypeGetFramebufferSize nvmlVgpuTypeGetGpuInstanceProfileId nvmlVgpuTypeGetGspHeapSize
    nvmlVgpuTypeGetLicense nvmlVgpuTypeGetMaxInstances nvmlVgpuTypeGetMaxInstancesPerVm
    nvmlVgpuTypeGetName nvmlVgpuTypeGetNumDisplayHeads nvmlVgpuTypeGetResolution
}
