/* The NVML queries monitoring tools and NVIDIA's k8s device plugin make (through go-nvml and
 * go-nvlib: brand, PCI bus id, memory, compute capability, MIG capability and device count,
 * addressing mode, fabric info), built against nvml.h (nvidia-nvml-dev 13.4.92) and linked with
 * -lnvidia-ml, with the error paths of each entry point crates/sim/nvml/src/board.rs and fields.rs
 * model. Prints one "key code values..." line per call for crates/sim/tests/monitoring.rs to
 * check against the machine model; exits non-zero only when a call it cannot go on without
 * fails. */
#include <nvml.h>
#include <stdio.h>
#include <string.h>

/* The v1 entry point under its exported name (nvml.h maps nvmlDeviceGetPciInfo to _v3). */
extern nvmlReturn_t pci_info_v1(nvmlDevice_t, void *) __asm__("nvmlDeviceGetPciInfo");

#define SHOW(key, r, fmt, ...) printf("%s %d " fmt "\n", key, (int)(r), __VA_ARGS__)
#define CODE(key, r) printf("%s %d\n", key, (int)(r))

int main(void) {
    unsigned int n = 0, units = 99;
    /* Before nvmlInit. */
    CODE("unit_count_uninit", nvmlUnitGetCount(&units));
    if (nvmlInit_v2() != NVML_SUCCESS) return 1;

    char text[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    int cuda = 0;
    nvmlReturn_t r = nvmlSystemGetDriverVersion(text, sizeof text);
    SHOW("driver_version", r, "%s", text);
    r = nvmlSystemGetCudaDriverVersion(&cuda);
    SHOW("cuda_driver_version", r, "%d", cuda);
    nvmlSystemDriverBranchInfo_t branch = {.version = nvmlSystemDriverBranchInfo_v1};
    r = nvmlSystemGetDriverBranch(&branch, sizeof branch.branch);
    SHOW("driver_branch", r, "%s", branch.branch);
    CODE("driver_branch_short", nvmlSystemGetDriverBranch(&branch, 3));
    CODE("driver_branch_null", nvmlSystemGetDriverBranch(NULL, 80));
    r = nvmlUnitGetCount(&units);
    SHOW("unit_count", r, "%u", units);
    nvmlUnit_t unit;
    CODE("unit_handle_0", nvmlUnitGetHandleByIndex(0, &unit));

    nvmlUnitInfo_t unit_info;
    CODE("unit_info_bad_unit", nvmlUnitGetUnitInfo(unit, &unit_info));
    unsigned int excluded = 99, hics = 4;
    nvmlHwbcEntry_t hic[4];
    r = nvmlGetExcludedDeviceCount(&excluded);
    SHOW("excluded_devices", r, "%u", excluded);
    r = nvmlSystemGetHicVersion(&hics, hic);
    SHOW("hic_count", r, "%u", hics);
    CODE("hic_null", nvmlSystemGetHicVersion(&hics, NULL));
    nvmlDevice_t by_serial;
    CODE("serial_unknown", nvmlDeviceGetHandleBySerial("0000000000000", &by_serial));
    nvmlUUID_t nowhere = {.version = nvmlUUID_v1, .type = NVML_UUID_TYPE_ASCII, .value.str = "GPU-00000000-0000-0000-0000-000000000000"};
    CODE("uuid_unknown", nvmlDeviceGetHandleByUUIDV(&nowhere, &by_serial));

    if (nvmlDeviceGetCount_v2(&n) != NVML_SUCCESS) return 1;
    printf("count 0 %u\n", n);
    for (unsigned int i = 0; i < n; i++) {
        nvmlDevice_t d;
        char key[64], name[NVML_DEVICE_NAME_V2_BUFFER_SIZE], uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
        if (nvmlDeviceGetHandleByIndex_v2(i, &d) != NVML_SUCCESS) return 1;
#define K(s) (snprintf(key, sizeof key, "%u.%s", i, s), key)
        r = nvmlDeviceGetName(d, name, sizeof name);
        SHOW(K("name"), r, "%s", name);
        r = nvmlDeviceGetUUID(d, uuid, sizeof uuid);
        SHOW(K("uuid"), r, "%s", uuid);

        /* What go-nvlib's device wrapper asks. */
        nvmlBrandType_t brand = 0;
        r = nvmlDeviceGetBrand(d, &brand);
        SHOW(K("brand"), r, "%d", (int)brand);
        CODE(K("brand_null"), nvmlDeviceGetBrand(d, NULL));
        nvmlPciInfo_t pci;
        r = nvmlDeviceGetPciInfo(d, &pci);
        SHOW(K("pci_v3"), r, "%s %x", pci.busId, pci.pciDeviceId);
        unsigned int minor = 0;
        r = nvmlDeviceGetMinorNumber(d, &minor);
        SHOW(K("minor"), r, "%u", minor);
        nvmlMemory_t mem;
        r = nvmlDeviceGetMemoryInfo(d, &mem);
        SHOW(K("memory"), r, "%llu", mem.total);
        int major = 0, cc_minor = 0;
        r = nvmlDeviceGetCudaComputeCapability(d, &major, &cc_minor);
        SHOW(K("cc"), r, "%d.%d", major, cc_minor);
        unsigned int mig = 9, pending = 9, mig_count = 99;
        r = nvmlDeviceGetMigMode(d, &mig, &pending);
        SHOW(K("mig_mode"), r, "%u %u", mig, pending);
        r = nvmlDeviceGetMaxMigDeviceCount(d, &mig_count);
        SHOW(K("max_mig_devices"), r, "%u", mig_count);
        nvmlDeviceAddressingMode_t addressing = {.version = nvmlDeviceAddressingMode_v1};
        CODE(K("addressing_mode"), nvmlDeviceGetAddressingMode(d, &addressing));
        nvmlGpuFabricInfo_t fabric;
        CODE(K("fabric_info"), nvmlDeviceGetGpuFabricInfo(d, &fabric));

        /* v1 PCI info: 36 bytes, the legacy bus id, nothing written past them. */
        unsigned char raw[sizeof(nvmlPciInfo_t)];
        memset(raw, 0xab, sizeof raw);
        r = pci_info_v1(d, raw);
        unsigned int v1_device_id;
        memcpy(&v1_device_id, raw + 16 + 12, 4);
        int untouched = 1;
        for (size_t b = 36; b < sizeof raw; b++) untouched &= raw[b] == 0xab;
        SHOW(K("pci_v1"), r, "%.16s %x %d", (char *)raw, v1_device_id, untouched);

        nvmlPciInfoExt_t ext = {.version = nvmlPciInfoExt_v1};
        r = nvmlDeviceGetPciInfoExt(d, &ext);
        SHOW(K("pci_ext"), r, "%s %u %u %x", ext.busId, ext.baseClass, ext.subClass, ext.pciSubSystemId);
        ext.version = 1;
        CODE(K("pci_ext_bad_version"), nvmlDeviceGetPciInfoExt(d, &ext));

        char vbios[NVML_DEVICE_VBIOS_VERSION_BUFFER_SIZE];
        r = nvmlDeviceGetVbiosVersion(d, vbios, sizeof vbios);
        SHOW(K("vbios"), r, "%s", vbios);
        CODE(K("vbios_short"), nvmlDeviceGetVbiosVersion(d, vbios, 4));

        nvmlEnableState_t persistence = 9, display = 9, active = 9, ecc = 9, ecc_pending = 9;
        nvmlPstates_t pstate = 99;
        nvmlGpuVirtualizationMode_t virt = 99;
        r = nvmlDeviceGetPersistenceMode(d, &persistence);
        SHOW(K("persistence"), r, "%d", (int)persistence);
        r = nvmlDeviceGetDisplayMode(d, &display);
        SHOW(K("display_mode"), r, "%d", (int)display);
        r = nvmlDeviceGetDisplayActive(d, &active);
        SHOW(K("display_active"), r, "%d", (int)active);
        r = nvmlDeviceGetPerformanceState(d, &pstate);
        SHOW(K("pstate"), r, "%d", (int)pstate);
        r = nvmlDeviceGetEccMode(d, &ecc, &ecc_pending);
        SHOW(K("ecc"), r, "%d %d", (int)ecc, (int)ecc_pending);
        r = nvmlDeviceGetVirtualizationMode(d, &virt);
        SHOW(K("virtualization"), r, "%d", (int)virt);
        unsigned long long ecc_count = 99;
        r = nvmlDeviceGetTotalEccErrors(d, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, &ecc_count);
        SHOW(K("ecc_errors"), r, "%llu", ecc_count);
        CODE(K("ecc_errors_bad_type"), nvmlDeviceGetTotalEccErrors(d, 7, NVML_VOLATILE_ECC, &ecc_count));

        unsigned int util = 99, period = 0, clock = 0, tput = 99;
        r = nvmlDeviceGetEncoderUtilization(d, &util, &period);
        SHOW(K("encoder"), r, "%u %u", util, period);
        r = nvmlDeviceGetDecoderUtilization(d, &util, &period);
        SHOW(K("decoder"), r, "%u %u", util, period);
        r = nvmlDeviceGetPcieThroughput(d, NVML_PCIE_UTIL_RX_BYTES, &tput);
        SHOW(K("pcie_rx"), r, "%u", tput);
        CODE(K("pcie_bad_counter"), nvmlDeviceGetPcieThroughput(d, NVML_PCIE_UTIL_COUNT, &tput));
        r = nvmlDeviceGetClockInfo(d, NVML_CLOCK_SM, &clock);
        SHOW(K("clock_sm"), r, "%u", clock);
        r = nvmlDeviceGetClockInfo(d, NVML_CLOCK_MEM, &clock);
        SHOW(K("clock_mem"), r, "%u", clock);
        CODE(K("clock_video"), nvmlDeviceGetClockInfo(d, NVML_CLOCK_VIDEO, &clock));
        CODE(K("clock_bad"), nvmlDeviceGetClockInfo(d, 77, &clock));

        nvmlDeviceCurrentClockFreqs_t freqs = {.version = nvmlDeviceCurrentClockFreqs_v1};
        r = nvmlDeviceGetCurrentClockFreqs(d, &freqs);
        SHOW(K("clock_freqs"), r, "%s", freqs.str);
        nvmlDevicePerfModes_t modes = {.version = nvmlDevicePerfModes_v1};
        r = nvmlDeviceGetPerformanceModes(d, &modes);
        SHOW(K("perf_modes"), r, "%s", modes.str);
        modes.version = 2;
        CODE(K("perf_modes_bad_version"), nvmlDeviceGetPerformanceModes(d, &modes));

        nvmlGridLicensableFeatures_t grid;
        memset(&grid, 0xab, sizeof grid);
        r = nvmlDeviceGetGridLicensableFeatures(d, &grid);
        SHOW(K("grid"), r, "%d %u", grid.isGridLicenseSupported, grid.licensableFeaturesCount);

        unsigned long long reasons = 99, supported = 0;
        r = nvmlDeviceGetCurrentClocksEventReasons(d, &reasons);
        SHOW(K("event_reasons"), r, "%llx", reasons);
        r = nvmlDeviceGetSupportedClocksEventReasons(d, &supported);
        SHOW(K("supported_event_reasons"), r, "%llx", supported);
        unsigned int sessions = 99, fps = 99, latency = 99;
        r = nvmlDeviceGetEncoderStats(d, &sessions, &fps, &latency);
        SHOW(K("encoder_stats"), r, "%u %u %u", sessions, fps, latency);
        sessions = 99;
        r = nvmlDeviceGetEncoderSessions(d, &sessions, NULL);
        SHOW(K("encoder_sessions"), r, "%u", sessions);
        nvmlFBCStats_t fbc = {99, 99, 99};
        r = nvmlDeviceGetFBCStats(d, &fbc);
        SHOW(K("fbc_stats"), r, "%u %u %u", fbc.sessionsCount, fbc.averageFPS, fbc.averageLatency);
        char serial[NVML_DEVICE_SERIAL_BUFFER_SIZE];
        unsigned int serial_index = 99;
        if (nvmlDeviceGetSerial(d, serial, sizeof serial) == NVML_SUCCESS &&
            (r = nvmlDeviceGetHandleBySerial(serial, &by_serial)) == NVML_SUCCESS)
            nvmlDeviceGetIndex(by_serial, &serial_index);
        SHOW(K("by_serial"), r, "%u", serial_index);

        /* The versioned UUID lookup, as text in upper case and as bytes. */
        nvmlUUID_t want = {.version = nvmlUUID_v1, .type = NVML_UUID_TYPE_ASCII};
        nvmlDevice_t by_uuid = NULL;
        unsigned int uuid_index = 99;
        for (size_t c = 0; uuid[c] && c < sizeof want.value.str - 1; c++)
            want.value.str[c] = (uuid[c] >= 'a' && uuid[c] <= 'f') ? uuid[c] - 32 : uuid[c];
        if ((r = nvmlDeviceGetHandleByUUIDV(&want, &by_uuid)) == NVML_SUCCESS) nvmlDeviceGetIndex(by_uuid, &uuid_index);
        SHOW(K("by_uuid_ascii"), r, "%u", uuid_index);
        want.type = NVML_UUID_TYPE_BINARY;
        memset(&want.value, 0, sizeof want.value);
        for (int b = 0, c = 4; b < 16 && uuid[c]; c++) { /* skip "GPU-" and the dashes */
            if (uuid[c] == '-') continue;
            unsigned int byte;
            sscanf(uuid + c, "%2x", &byte);
            want.value.bytes[b++] = (unsigned char)byte;
            c++;
        }
        uuid_index = 99;
        if ((r = nvmlDeviceGetHandleByUUIDV(&want, &by_uuid)) == NVML_SUCCESS) nvmlDeviceGetIndex(by_uuid, &uuid_index);
        SHOW(K("by_uuid_binary"), r, "%u", uuid_index);
        want.type = 7;
        CODE(K("by_uuid_bad_type"), nvmlDeviceGetHandleByUUIDV(&want, &by_uuid));
        want.type = NVML_UUID_TYPE_BINARY;
        want.version = 1;
        CODE(K("by_uuid_bad_version"), nvmlDeviceGetHandleByUUIDV(&want, &by_uuid));
        CODE(K("clear_cpu_affinity"), nvmlDeviceClearCpuAffinity(d));
        unsigned int gen[3] = {0}, width[2] = {0};
        nvmlReturn_t rs[5] = {nvmlDeviceGetMaxPcieLinkGeneration(d, &gen[0]), nvmlDeviceGetGpuMaxPcieLinkGeneration(d, &gen[1]),
                              nvmlDeviceGetCurrPcieLinkGeneration(d, &gen[2]), nvmlDeviceGetMaxPcieLinkWidth(d, &width[0]),
                              nvmlDeviceGetCurrPcieLinkWidth(d, &width[1])};
        r = NVML_SUCCESS;
        for (int c = 0; c < 5; c++) if (rs[c] != NVML_SUCCESS) r = rs[c];
        SHOW(K("pcie_link"), r, "%u %u %u %u %u", gen[0], gen[1], gen[2], width[0], width[1]);
        CODE(K("pcie_link_null"), nvmlDeviceGetCurrPcieLinkWidth(d, NULL));

        /* Field values: modelled, per-link, not modelled and out-of-range ids in one call. */
        nvmlFieldValue_t f[8];
        memset(f, 0, sizeof f);
        unsigned int ids[8] = {NVML_FI_DEV_ECC_CURRENT, NVML_FI_DEV_NVLINK_LINK_COUNT,
                               NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_POWER_INSTANT,
                               NVML_FI_DEV_POWER_AVERAGE, NVML_FI_DEV_MEMORY_TEMP,
                               NVML_FI_DEV_PCIE_REPLAY_COUNTER, NVML_FI_MAX};
        for (int k = 0; k < 8; k++) f[k].fieldId = ids[k];
        r = nvmlDeviceGetFieldValues(d, 8, f);
        printf("%u.fields %d", i, (int)r);
        for (int k = 0; k < 8; k++)
            printf(" %u:%d:%d:%llu", f[k].fieldId, (int)f[k].nvmlReturn, (int)f[k].valueType,
                   f[k].valueType == NVML_VALUE_TYPE_UNSIGNED_INT ? (unsigned long long)f[k].value.uiVal
                                                                  : f[k].value.ullVal);
        printf("\n");
        /* The link past the last is an invalid scope. */
        nvmlFieldValue_t past = {.fieldId = NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, .scopeId = NVML_NVLINK_MAX_LINKS};
        r = nvmlDeviceGetFieldValues(d, 1, &past);
        SHOW(K("field_past_last_link"), r, "%d", (int)past.nvmlReturn);
        CODE(K("fields_null"), nvmlDeviceGetFieldValues(d, 1, NULL));
    }
    CODE("brand_bad_handle", nvmlDeviceGetBrand((nvmlDevice_t)&n, &(nvmlBrandType_t){0}));
    nvmlShutdown();
    return 0;
}
