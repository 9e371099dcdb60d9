/* Stand-in for the Ascend CANN runtime libraries memfabric loads (libascendcl, libascend_hal, libra,
 * libtsdclient, libhccl, libdcmi, ...), for MemCache on a CPU host with the host_shm transport.
 * Device ids map to themselves; device allocations are host allocations; every memcpy is memmove, so
 * the bytes MemCache moves are real. Each other symbol memfabric resolves succeeds and does nothing. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int32_t current_device;
static char opaque_handle[4096];   /* streams, contexts, notifies: one shared dummy object */
int g_devmm_mem_dev = -1;

/* devices */
int aclrtSetDevice(int32_t id) { current_device = id; return 0; }
int aclrtGetDevice(int32_t *id) { if (id) *id = current_device; return 0; }
int rtGetLogicDevIdByUserDevId(int32_t user, int32_t *logic) { if (logic) *logic = user; return 0; }
int aclrtGetPhyDevIdByLogicDevId(int32_t logic, int32_t *phy) { if (phy) *phy = logic; return 0; }
int rtDeviceGetBareTgid(uint32_t *tgid) { if (tgid) *tgid = (uint32_t)getpid(); return 0; }
int rtGetDeviceInfo(uint32_t dev, int32_t module, int32_t type, int64_t *value) { if (value) *value = 0; return 0; }
const char *aclrtGetSocName(void) { return "Ascend910B1"; }
int aclrtGetVersion(int32_t *major, int32_t *minor, int32_t *patch) {
    if (major) *major = 1;
    if (minor) *minor = 0;
    if (patch) *patch = 0;
    return 0;
}
int aclsysGetVersionStr(char *package, char *out) { if (out) strcpy(out, "8.3.0"); return 0; }

/* memory */
static int host_alloc(void **p, size_t n) { return posix_memalign(p, 4096, n ? n : 1) ? 1 : 0; }
int aclrtMalloc(void **p, size_t n, int policy) { return host_alloc(p, n); }
int aclrtMallocHost(void **p, size_t n) { return host_alloc(p, n); }
int aclrtFree(void *p) { free(p); return 0; }
int aclrtFreeHost(void *p) { free(p); return 0; }
int aclrtMemset(void *p, size_t cap, int32_t v, size_t n) { memset(p, v, n < cap ? n : cap); return 0; }
int aclrtMemcpy(void *dst, size_t cap, const void *src, size_t n, int kind) {
    if (n > cap) return 1;
    memmove(dst, src, n);
    return 0;
}
int aclrtMemcpyAsync(void *dst, size_t cap, const void *src, size_t n, int kind, void *stream) {
    return aclrtMemcpy(dst, cap, src, n, kind);
}
int rtMemcpyAsyncWithoutCheckKind(void *dst, uint64_t cap, const void *src, uint64_t n, int kind, void *stream) {
    memmove(dst, src, n);
    return 0;
}
int aclrtMemcpy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height, int kind) {
    for (size_t row = 0; row < height; row++)
        memmove((char *)dst + row * dpitch, (const char *)src + row * spitch, width);
    return 0;
}
int aclrtMemcpy2dAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height, int kind, void *stream) {
    return aclrtMemcpy2d(dst, dpitch, src, spitch, width, height, kind);
}
int halHostRegister(void *host, uint64_t size, uint32_t flag, uint32_t dev, void **dev_ptr) { if (dev_ptr) *dev_ptr = host; return 0; }
int halMemGetAllocationGranularity(void *prop, int option, size_t *granularity) { if (granularity) *granularity = 2u << 20; return 0; }

/* streams, contexts, notifies */
int aclrtCreateStream(void **s) { if (s) *s = opaque_handle; return 0; }
int aclrtCreateStreamWithConfig(void **s, uint32_t priority, uint32_t flag) { if (s) *s = opaque_handle; return 0; }
int aclrtGetCurrentContext(void **c) { if (c) *c = opaque_handle; return 0; }
int aclrtCreateNotify(void **n, uint64_t flag) { if (n) *n = opaque_handle; return 0; }
int aclrtStreamGetId(void *s, int32_t *id) { if (id) *id = 0; return 0; }
int rtStreamGetSqid(void *s, uint32_t *id) { if (id) *id = 0; return 0; }
int rtStreamGetCqid(void *s, uint32_t *id) { if (id) *id = 0; return 0; }
int aclrtGetNotifyId(void *n, uint32_t *id) { if (id) *id = 0; return 0; }

/* everything else memfabric resolves: succeed, do nothing */
#define SUCCEED(name) int name(void) { return 0; }
SUCCEED(aclrtDestroyStream) SUCCEED(aclrtSynchronizeStream) SUCCEED(aclrtDeviceEnablePeerAccess)
SUCCEED(aclrtSetStreamAttribute) SUCCEED(aclrtStreamAbort) SUCCEED(aclrtDestroyNotify)
SUCCEED(aclrtWaitAndResetNotify) SUCCEED(aclrtBinaryGetFunction) SUCCEED(aclrtBinaryLoadFromFile)
SUCCEED(aclrtKernelArgsAppend) SUCCEED(aclrtKernelArgsFinalize) SUCCEED(aclrtKernelArgsInit)
SUCCEED(aclrtLaunchKernelWithConfig) SUCCEED(aclCreateTensor) SUCCEED(aclDestroyTensor)
SUCCEED(aclnnShmemSdmaStarsQuery) SUCCEED(aclnnShmemSdmaStarsQueryGetWorkspaceSize)
SUCCEED(rtSetIpcMemorySuperPodPid) SUCCEED(rtIpcDestroyMemoryName) SUCCEED(rtIpcSetMemoryName)
SUCCEED(rtIpcOpenMemory) SUCCEED(rtIpcCloseMemory) SUCCEED(rtEnableP2P) SUCCEED(rtDisableP2P)
SUCCEED(rtGetP2PStatus) SUCCEED(rtGetDevResAddress) SUCCEED(HcclCommDestroy)
SUCCEED(HcclCommInitClusterInfoMemConfig) SUCCEED(dcmiv2_init) SUCCEED(dcmiv2_get_affinity_cpu_info_by_dev_id)
SUCCEED(dcmiv2_get_device_pcie_info) SUCCEED(dcmiv2_get_eid_list_by_urma_dev_index) SUCCEED(dcmiv2_get_urma_device_cnt)
SUCCEED(drvMemGetAttribute) SUCCEED(drvNotifyIdAddrOffset) SUCCEED(halCqReportRecv) SUCCEED(halHostUnregisterEx)
SUCCEED(halMemAddressFree) SUCCEED(halMemAddressReserve) SUCCEED(halMemAlloc) SUCCEED(halMemCreate)
SUCCEED(halMemExportToShareableHandleV2) SUCCEED(halMemFree) SUCCEED(halMemImportFromShareableHandleV2)
SUCCEED(halMemMap) SUCCEED(halMemRelease) SUCCEED(halMemRetainAllocationHandle) SUCCEED(halMemSetAccess)
SUCCEED(halMemShareHandleSetAttribute) SUCCEED(halMemTransShareableHandle) SUCCEED(halMemUnmap)
SUCCEED(halResourceConfig) SUCCEED(halResourceDetailQuery) SUCCEED(halResourceIdAlloc) SUCCEED(halResourceIdFree)
SUCCEED(halSqCqAllocate) SUCCEED(halSqCqFree) SUCCEED(halSqCqQuery) SUCCEED(halSqTaskSend)
SUCCEED(svm_module_alloced_size_inc) SUCCEED(devmm_virt_alloc_mem_from_base) SUCCEED(devmm_ioctl_enable_heap)
SUCCEED(devmm_get_heap_list_by_type) SUCCEED(devmm_virt_set_heap_idle) SUCCEED(devmm_virt_get_heap_mgmt)
SUCCEED(devmm_ioctl_free_pages) SUCCEED(devmm_va_to_heap_idx) SUCCEED(devmm_virt_get_heap_from_queue)
SUCCEED(devmm_virt_normal_heap_update_info) SUCCEED(devmm_va_to_heap) SUCCEED(devmm_virt_destroy_heap)
SUCCEED(devmm_assign_rbtree_node_data) SUCCEED(devmm_rbtree_insert_idle_size_tree)
SUCCEED(devmm_rbtree_insert_idle_va_tree) SUCCEED(devmm_alloc_rbtree_node) SUCCEED(devmm_rbtree_erase_idle_va_tree)
SUCCEED(devmm_rbtree_erase_idle_size_tree) SUCCEED(devmm_rbtree_get_alloced_node_in_range)
SUCCEED(devmm_rbtree_get_idle_va_node_in_range) SUCCEED(devmm_rbtree_insert_alloced_tree) SUCCEED(devmm_free_rbtree_node)
SUCCEED(ra_ai_qp_create) SUCCEED(ra_deregister_mr) SUCCEED(ra_get_ifaddrs) SUCCEED(ra_get_ifnum)
SUCCEED(ra_get_notify_base_addr) SUCCEED(ra_get_notify_mr_info) SUCCEED(ra_get_qp_status) SUCCEED(ra_get_sockets)
SUCCEED(ra_init) SUCCEED(ra_qp_connect_async) SUCCEED(ra_qp_create) SUCCEED(ra_qp_create_with_attrs)
SUCCEED(ra_qp_destroy) SUCCEED(ra_rdev_get_handle) SUCCEED(ra_rdev_init_v2) SUCCEED(ra_register_mr)
SUCCEED(ra_send_wr) SUCCEED(ra_send_wr_v2) SUCCEED(ra_set_qp_attr_qos) SUCCEED(ra_socket_batch_close)
SUCCEED(ra_socket_batch_connect) SUCCEED(ra_socket_deinit) SUCCEED(ra_socket_init) SUCCEED(ra_socket_listen_start)
SUCCEED(ra_socket_listen_stop) SUCCEED(ra_socket_white_list_add) SUCCEED(ra_socket_white_list_del)
SUCCEED(TsdOpen) SUCCEED(TsdClose)
