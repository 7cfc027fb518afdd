//! Modules, libraries and functions: loading images (cuModuleLoad*, cuLibraryLoad*), the
//! registry of modules, functions, libraries and kernels the other chapters resolve handles in,
//! module globals, what an image says its kernels use (per GPU architecture) and what a program
//! sets on a function, and what a launch of a function costs (`kernel_ns`) and may ask
//! (`check_dims`). Launches are `launch`; what modules and libraries are asked, `module_info`;
//! function attributes and the occupancy calculator, `occupancy`.
//!
//! Time model: a kernel takes the device's timeline for its run time (`sim_busy*`: the first u64
//! parameter in ns; others: the model's default). The timeline is shared by every process, so
//! kernels of all processes run one after another. A stream remembers when its last work ends;
//! events, queries and synchronization follow from those times and the wall clock.

use crate::{cstr, ctx, drv, export, mem, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_image::resources::{self, Resources};
use cuvisor_image::{self as image, Image};
use cuvisor_sim::model::Device;

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_uint, c_void};
use std::sync::atomic::AtomicI32;
use std::sync::{Arc, Mutex, OnceLock};

/// Writes `v` where the caller asked for it (an optional out-parameter).
fn write_opt<T>(p: *mut T, v: T) -> Res {
    if p.is_null() {
        Ok(())
    } else {
        write(p, v)
    }
}

// ---- what an image says its kernels use, and what a program sets on a function -------------------

/// A module image's kernels and their resources, per SM number of the machine's GPUs.
pub(crate) type PerArch = HashMap<u32, BTreeMap<String, Resources>>;

pub(crate) fn sm_of(d: &Device) -> u32 {
    d.cc.0 * 10 + d.cc.1
}

/// What `read(sm)` gives for each distinct architecture among the model's GPUs.
fn per_arch(read: impl Fn(u32) -> BTreeMap<String, Resources>) -> PerArch {
    let Ok(d) = drv() else {
        return PerArch::new();
    };
    let mut out = PerArch::new();
    for dev in &d.sim.model.devices {
        out.entry(sm_of(dev)).or_insert_with(|| read(sm_of(dev)));
    }
    out
}

/// [`PerArch`] of an image at `p` as cuModuleLoadData / cuLibraryLoadData get it.
///
/// # Safety
/// As `cuvisor_image::from_ptr`: `p` is NULL or an image readable as its headers say.
pub(crate) unsafe fn per_arch_at(p: *const c_void) -> PerArch {
    // SAFETY: the caller's contract, passed on.
    per_arch(|sm| unsafe { resources::for_arch_at(p, sm) })
}

/// [`PerArch`] of an image file's bytes (cuModuleLoad, cuLibraryLoadFromFile).
pub(crate) fn per_arch_of_bytes(b: &[u8]) -> PerArch {
    per_arch(|sm| resources::for_arch(b, sm))
}

/// What `cuFuncSetAttribute` / `cuKernelSetAttribute` / `cuFuncSetCacheConfig` set on a
/// function; -1 where unset.
pub(crate) struct FuncState {
    pub(crate) max_dynamic_shared: AtomicI32,
    pub(crate) carveout: AtomicI32,
    pub(crate) cache_config: AtomicI32,
    pub(crate) cluster: [AtomicI32; 3],
    pub(crate) non_portable_cluster: AtomicI32,
    pub(crate) cluster_scheduling: AtomicI32,
    pub(crate) shared_memory_mode: AtomicI32,
}

impl Default for FuncState {
    fn default() -> Self {
        FuncState {
            max_dynamic_shared: AtomicI32::new(-1),
            carveout: AtomicI32::new(-1),
            cache_config: AtomicI32::new(0),
            cluster: [AtomicI32::new(0), AtomicI32::new(0), AtomicI32::new(0)],
            non_portable_cluster: AtomicI32::new(0),
            cluster_scheduling: AtomicI32::new(0),
            shared_memory_mode: AtomicI32::new(0),
        }
    }
}

struct Module {
    /// What the image defines, where the simulator can read it.
    image: Image,
    funcs: Mutex<HashMap<String, usize>>,
    /// The device memory behind each variable, per context: (context, name) → address; the name
    /// "" is the module's code (`module_code`).
    globals: Mutex<HashMap<(usize, String), u64>>,
    /// Each kernel's registers and memory, per architecture of the machine's GPUs (`occupancy`).
    resources: PerArch,
}

pub(crate) struct Function {
    /// `sim_busy*`: run time comes from the first parameter.
    pub busy: bool,
    module: usize,
    /// Its name in the module (what its resources are found under).
    name: String,
    /// What cuFuncSetAttribute and its kin set (`occupancy`).
    pub state: FuncState,
}

/// A library (CUDA 12.0's context-independent loading, `cuLibraryLoadData`): the module it is in
/// every context (the simulator's modules belong to no context, so one serves all), and the
/// kernels asked for by name.
struct Library {
    module: usize,
    kernels: Mutex<HashMap<String, usize>>,
}

/// A `CUkernel`: a function of a library, independent of the context. The simulator's function
/// objects are too, so it stands for the one function of that name in the library's module.
struct Kernel {
    function: usize,
}

fn modules() -> &'static Registry<Module> {
    static R: OnceLock<Registry<Module>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn functions() -> &'static Registry<Function> {
    static R: OnceLock<Registry<Function>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn libraries() -> &'static Registry<Library> {
    static R: OnceLock<Registry<Library>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn kernels() -> &'static Registry<Kernel> {
    static R: OnceLock<Registry<Kernel>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// Run time of a launch: `sim_busy*` kernels say it in their first parameter (a u64, in ns),
/// passed either through `kernelParams` or the `extra` buffer.
pub(crate) fn kernel_ns(
    f: &Function,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<u64, CUresult> {
    if !f.busy {
        return Ok(drv()?.sim.model.default_kernel_ns);
    }
    if !params.is_null() {
        let first: *const u64 = read(params as *const *const u64)?;
        return read(first);
    }
    if !extra.is_null() {
        let mut i = 0;
        loop {
            let key = read(unsafe_index(extra, i))? as usize;
            match key {
                CU_LAUNCH_PARAM_END => break,
                CU_LAUNCH_PARAM_BUFFER_POINTER => {
                    let buf = read(unsafe_index(extra, i + 1))?;
                    return read(buf as *const u64);
                }
                _ => i += 2,
            }
            if i > 64 {
                break;
            }
        }
    }
    // A sim_busy kernel has a parameter; launching it without one is the driver's INVALID_VALUE.
    Err(err::INVALID_VALUE)
}

/// `&arr[i]` for a caller-provided `void*` array (pointer arithmetic only; reads go through `read`).
fn unsafe_index(arr: *mut *mut c_void, i: usize) -> *const *mut c_void {
    arr.wrapping_add(i)
}

pub(crate) struct Dims {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
}

pub(crate) fn check_dims(d: &Dims, cooperative: bool, dev: usize) -> Res {
    let [gx, gy, gz] = d.grid;
    let [bx, by, bz] = d.block;
    if gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 {
        return Err(err::INVALID_VALUE);
    }
    if gy > 65535 || gz > 65535 || bx > 1024 || by > 1024 || bz > 64 {
        return Err(err::INVALID_VALUE);
    }
    let threads = bx as u64 * by as u64 * bz as u64;
    if threads > 1024 {
        return Err(err::INVALID_VALUE);
    }
    if cooperative {
        // All blocks of a cooperative grid must be co-resident.
        let sm = drv()?.sim.model.devices[dev].sm_count as u64;
        let per_sm = (2048 / threads).min(32);
        if gx as u64 * gy as u64 * gz as u64 > sm * per_sm {
            return Err(err::COOPERATIVE_LAUNCH_TOO_LARGE);
        }
    }
    Ok(())
}

/// What the launches take: a `CUfunction`, or since CUDA 12.0 a `CUkernel` ("f - Function
/// CUfunction or Kernel CUkernel to launch", cuda.h on cuLaunchKernel, cuLaunchKernelEx and
/// cuLaunchCooperativeKernel), which runs as its function in the current context.
pub(crate) fn function_or_kernel(f: CUfunction) -> Result<Arc<Function>, CUresult> {
    match functions().get(f as usize) {
        Ok(func) => Ok(func),
        Err(e) => match kernels().get(f as usize) {
            Ok(k) => {
                ctx::current()?;
                functions().get(k.function)
            }
            Err(_) => Err(e),
        },
    }
}

/// A new module object of `image`, in no context.
fn new_module(image: Image, resources: PerArch) -> usize {
    modules()
        .insert(Module {
            image,
            funcs: Mutex::new(HashMap::new()),
            globals: Mutex::new(HashMap::new()),
            resources,
        })
        .0
}

/// What kernel `f` needs on a GPU of SM number `sm`, where its module has a cubin for it.
pub(crate) fn function_resources(f: &Function, sm: u32) -> Option<image::resources::Resources> {
    let m = modules().get(f.module).ok()?;
    m.resources.get(&sm)?.get(&f.name).copied()
}

// ---- what the module queries (`module_info`) read ----------------------------------------------

/// The kernel names module `module` defines for a GPU of SM number `sm`, sorted, where the
/// simulator can read them (a cubin or PTX image, or a fat binary with a cubin for `sm`).
pub(crate) fn module_kernels(module: usize, sm: u32) -> Result<Option<Vec<String>>, CUresult> {
    let m = modules().get(module)?;
    if let Image::Known(s) = &m.image {
        return Ok(Some(s.kernels.iter().cloned().collect()));
    }
    Ok(m.resources
        .get(&sm)
        .filter(|k| !k.is_empty())
        .map(|k| k.keys().cloned().collect()))
}

/// The function `name` of module `module` (one handle per name), as cuModuleGetFunction gives it.
pub(crate) fn module_function_of(module: usize, name: &str) -> Result<usize, CUresult> {
    let m = modules().get(module)?;
    module_function(module, &m, name)
}

/// The module behind library `library`.
pub(crate) fn library_module(library: usize) -> Result<usize, CUresult> {
    Ok(libraries().get(library)?.module)
}

/// The kernel `name` of library `library` (one handle per name), as cuLibraryGetKernel gives it.
pub(crate) fn library_kernel(library: usize, name: &str) -> Result<usize, CUresult> {
    let l = libraries().get(library)?;
    let m = modules().get(l.module)?;
    let mut ks = l.kernels.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&k) = ks.get(name) {
        return Ok(k);
    }
    let function = module_function(l.module, &m, name)?;
    let k = kernels().insert(Kernel { function }).0;
    ks.insert(name.to_string(), k);
    Ok(k)
}

/// The library a kernel handle came from.
pub(crate) fn kernel_library(kernel: usize) -> Result<usize, CUresult> {
    kernels().get(kernel)?;
    let mut found = None;
    libraries().retain(|&h, l| {
        if l.kernels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .any(|&k| k == kernel)
        {
            found = Some(h);
        }
        true
    });
    found.ok_or(err::INVALID_HANDLE)
}

/// The function behind a library kernel handle, without asking for a context.
pub(crate) fn kernel_function_handle(kernel: usize) -> Result<usize, CUresult> {
    Ok(kernels().get(kernel)?.function)
}

impl Function {
    /// Its (mangled) name in its module.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

/// The function behind a `CUfunction` handle.
pub(crate) fn function(f: CUfunction) -> Result<Arc<Function>, CUresult> {
    functions().get(f as usize)
}

/// The function a library kernel (`CUkernel`) stands for.
pub(crate) fn kernel_function(k: *mut c_void) -> Result<Arc<Function>, CUresult> {
    let k = kernels().get(k as usize)?;
    functions().get(k.function)
}

/// Whether a kernel of this name is a `sim_busy*` one, under C linkage (`sim_busy_ms`) or C++
/// linkage, whose Itanium-mangled name is `_Z` then the identifier's length and the identifier
/// (`_Z8sim_busyy` for `sim_busy(unsigned long long)`; Itanium C++ ABI, "Mangling",
/// <https://itanium-cxx-abi.github.io/cxx-abi/abi.html#mangling>). NVRTC and nvcc mangle
/// kernels so (CuPy's `name_expressions` resolve to such names).
fn is_busy(name: &str) -> bool {
    const BUSY: &str = "sim_busy";
    if name.starts_with(BUSY) {
        return true;
    }
    let Some(rest) = name.strip_prefix("_Z") else {
        return false;
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    match rest[..digits].parse::<usize>() {
        Ok(len) => rest[digits..]
            .get(..len)
            .is_some_and(|id| id.starts_with(BUSY)),
        Err(_) => false,
    }
}

/// The function `name` of module `m`, made on first ask; CUDA_ERROR_NOT_FOUND if the image
/// does not define that kernel (in an image the simulator cannot read, any name resolves).
fn module_function(module: usize, m: &Module, name: &str) -> Result<usize, CUresult> {
    if !m.image.has_kernel(name) {
        return Err(err::NOT_FOUND);
    }
    let mut funcs = m.funcs.lock().unwrap_or_else(|e| e.into_inner());
    Ok(*funcs.entry(name.to_string()).or_insert_with(|| {
        functions()
            .insert(Function {
                busy: is_busy(name),
                module,
                name: name.to_string(),
                state: FuncState::default(),
            })
            .0
    }))
}

/// The variable `name` of module `m` in the current context: its address and size, its memory
/// allocated the first time it is asked for in a context (cuModuleLoadData* allocates every
/// variable at load; a library's are made as its contexts ask). CUDA_ERROR_NOT_FOUND if the
/// image defines no such variable.
fn module_global(m: &Module, name: &str) -> Result<(u64, u64), CUresult> {
    let (ch, _) = ctx::current()?;
    let size = m.image.global(name).ok_or(err::NOT_FOUND)?;
    let mut g = m.globals.lock().unwrap_or_else(|e| e.into_inner());
    let key = (ch, name.to_string());
    if let Some(&addr) = g.get(&key) {
        if mem::module_global_live(addr, ch) {
            return Ok((addr, size));
        }
    }
    let addr = mem::alloc_module_global(size)?;
    g.insert(key, addr);
    Ok((addr, size))
}

/// cuModuleGetGlobal_v2 / cuLibraryGetGlobal: both out-parameters are optional ("If one of them
/// is NULL, it is ignored", CUDA driver API reference).
fn get_global(
    dptr: *mut CUdeviceptr,
    bytes: *mut usize,
    module: usize,
    name: *const c_char,
) -> Res {
    let m = modules().get(module)?;
    let name = cstr(name)?;
    let (addr, size) = module_global(&m, name)?;
    write_opt(dptr, addr as CUdeviceptr)?;
    write_opt(bytes, size as usize)
}

/// Options come as `n` keys and `n` values; either array missing while `n` > 0 is the
/// caller's mistake. The simulator compiles nothing, so it ignores what they say.
fn check_options(n: c_uint, keys: *const c_void, values: *const c_void) -> Res {
    if n > 0 && (keys.is_null() || values.is_null()) {
        return Err(err::INVALID_VALUE);
    }
    Ok(())
}

/// CU_LIBRARY_BINARY_IS_PRESERVED (`CUlibraryOption` 1): a hint that `code` outlives the
/// library, with no parameter (the driver API reference, `CUlibraryOption`, describes none; the
/// driver "can choose to ignore it"). cuBLASLt 12.8 passes it alone with a NULL value array for
/// some of its loads (4 of 3515 during PyTorch's first fp32 GEMM, seen on the simulator), and
/// asks those libraries for kernels; CUDA 12 fp16 GEMMs run on real GPUs, so the driver accepts
/// that.
const CU_LIBRARY_BINARY_IS_PRESERVED: i32 = 1;

/// Library options: the value array may be NULL where every option is one without a parameter.
fn check_library_options(n: c_uint, keys: *const c_void, values: *const c_void) -> Res {
    if n > 0 && !keys.is_null() && values.is_null() {
        // SAFETY: the caller passes `n` options at `keys` (the driver API contract).
        let keys = unsafe { std::slice::from_raw_parts(keys as *const i32, n as usize) };
        if keys.iter().all(|&k| k == CU_LIBRARY_BINARY_IS_PRESERVED) {
            return Ok(());
        }
    }
    check_options(n, keys, values)
}

/// cuLibraryLoadData / cuLibraryLoadFromFile (CUDA 12.0): no current context is needed (the
/// library is loaded into contexts as they need it).
#[allow(clippy::too_many_arguments)]
fn load_library(
    library: *mut *mut c_void,
    code: *const c_void,
    image: impl FnOnce() -> (Image, PerArch),
    jit_n: c_uint,
    jit_keys: *const c_void,
    jit_values: *const c_void,
    lib_n: c_uint,
    lib_keys: *const c_void,
    lib_values: *const c_void,
) -> Res {
    drv()?;
    if library.is_null() || code.is_null() {
        return Err(err::INVALID_VALUE);
    }
    check_options(jit_n, jit_keys, jit_values)?;
    check_library_options(lib_n, lib_keys, lib_values)?;
    let (image, resources) = image();
    // Any image loads: the simulator has no ISA to check.
    let (h, _) = libraries().insert(Library {
        module: new_module(image, resources),
        kernels: Mutex::new(HashMap::new()),
    });
    write(library, h as *mut c_void)
}

/// Reads an image file (cuModuleLoad, cuLibraryLoadFromFile); one that cannot be read is
/// opaque (the caller checked it is a file).
fn image_file(path: &str) -> (Image, PerArch) {
    match std::fs::read(path) {
        Ok(b) => (image::from_bytes(&b), per_arch_of_bytes(&b)),
        Err(_) => (Image::Opaque, PerArch::new()),
    }
}

/// An image as cuModuleLoadData gets it, and its kernels' resources.
///
/// # Safety
/// `p` is NULL or an image readable as its headers say (see `image::from_ptr`).
unsafe fn image_at(p: *const c_void) -> (Image, PerArch) {
    // SAFETY: the caller's contract, passed on.
    unsafe { (image::from_ptr(p), per_arch_at(p)) }
}

pub(crate) fn load_module(module: *mut CUmodule, image: *const c_void) -> Res {
    // SAFETY: the caller's image, readable by the driver API's contract (see `image::from_ptr`).
    load_module_of(module, image, || unsafe { image_at(image) })
}

/// Loads `read()`'s image into the current context, with memory for each of its variables.
fn load_module_of(
    module: *mut CUmodule,
    code: *const c_void,
    read: impl FnOnce() -> (Image, PerArch),
) -> Res {
    ctx::current()?;
    if module.is_null() || code.is_null() {
        return Err(err::INVALID_VALUE);
    }
    // Any image loads: the simulator has no ISA to check.
    let (image, resources) = read();
    let names: Vec<String> = image.globals().into_iter().map(|(n, _)| n).collect();
    let h = new_module(image, resources);
    let m = modules().get(h)?;
    for n in names {
        if let Err(e) = module_global(&m, &n) {
            let _ = unload_module(h);
            return Err(e);
        }
    }
    if let Err(e) = module_code(&m) {
        let _ = unload_module(h);
        return Err(e);
    }
    write(module, h as CUmodule)
}

/// The module's code in the current context: device memory of its code sections' size
/// (`Image::code_bytes`), held with its variables (under the name "", which no symbol has) and
/// given back with them when the module is unloaded or the context goes. The real driver
/// copies a module's code into device memory when it loads it (cuModuleLoad*, which load
/// eagerly; a library's code is loaded into a context at first use under lazy loading, which
/// the simulator does not charge).
fn module_code(m: &Module) -> Res {
    let size = m.image.code_bytes();
    if size == 0 {
        return Ok(());
    }
    let (ch, _) = ctx::current()?;
    let addr = mem::alloc_module_global(size)?;
    let mut g = m.globals.lock().unwrap_or_else(|e| e.into_inner());
    g.insert((ch, String::new()), addr);
    Ok(())
}

/// Unloads a module and the functions got from it.
fn unload_module(module: usize) -> Res {
    let m = modules().remove(module)?;
    let funcs: Vec<usize> = m
        .funcs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .copied()
        .collect();
    for f in funcs {
        let _ = functions().remove(f);
    }
    for (_, addr) in m.globals.lock().unwrap_or_else(|e| e.into_inner()).drain() {
        mem::free_module_global(addr);
    }
    Ok(())
}

export! {
    fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) { load_module(module, image) }
    fn cuModuleLoadFatBinary(module: *mut CUmodule, image: *const c_void) { load_module(module, image) }
    fn cuModuleLoadDataEx(module: *mut CUmodule, image: *const c_void, nopts: c_uint, _opts: *mut c_void, _vals: *mut *mut c_void) {
        let _ = nopts;
        load_module(module, image)
    }
    fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) {
        let path = cstr(fname)?;
        if !std::path::Path::new(path).is_file() {
            return Err(err::FILE_NOT_FOUND);
        }
        load_module_of(module, fname as *const c_void, || image_file(path))
    }
    fn cuModuleUnload(module: CUmodule) {
        drv()?;
        unload_module(module as usize)
    }
    fn cuModuleGetFunction(hfunc: *mut CUfunction, module: CUmodule, name: *const c_char) {
        drv()?;
        let m = modules().get(module as usize)?;
        let name = cstr(name)?;
        if hfunc.is_null() {
            return Err(err::INVALID_VALUE);
        }
        write(hfunc, module_function(module as usize, &m, name)? as CUfunction)
    }

    fn cuLibraryLoadData(library: *mut *mut c_void, code: *const c_void, jit_keys: *const c_void, jit_values: *const c_void, jit_n: c_uint, lib_keys: *const c_void, lib_values: *const c_void, lib_n: c_uint) {
        // SAFETY: the caller's image, readable by the driver API's contract.
        load_library(library, code, || unsafe { image_at(code) }, jit_n, jit_keys, jit_values, lib_n, lib_keys, lib_values)
    }
    fn cuLibraryLoadFromFile(library: *mut *mut c_void, file: *const c_char, jit_keys: *const c_void, jit_values: *const c_void, jit_n: c_uint, lib_keys: *const c_void, lib_values: *const c_void, lib_n: c_uint) {
        drv()?;
        let path = cstr(file)?;
        if !std::path::Path::new(path).is_file() {
            return Err(err::FILE_NOT_FOUND);
        }
        load_library(library, file as *const c_void, || image_file(path), jit_n, jit_keys, jit_values, lib_n, lib_keys, lib_values)
    }
    /// The library goes, and with it its module, its kernels and their functions.
    fn cuLibraryUnload(library: *mut c_void) {
        drv()?;
        let l = libraries().remove(library as usize)?;
        for (_, k) in l.kernels.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            let _ = kernels().remove(k);
        }
        unload_module(l.module)
    }
    /// The library's module in the current context.
    fn cuLibraryGetModule(pmod: *mut CUmodule, library: *mut c_void) {
        let l = libraries().get(library as usize)?;
        ctx::current()?;
        write(pmod, l.module as CUmodule)
    }
    /// The kernel `name`; one handle per name (any name resolves, as in cuModuleGetFunction).
    fn cuLibraryGetKernel(pkernel: *mut *mut c_void, library: *mut c_void, name: *const c_char) {
        drv()?;
        libraries().get(library as usize)?;
        let name = cstr(name)?;
        if pkernel.is_null() {
            return Err(err::INVALID_VALUE);
        }
        write(pkernel, library_kernel(library as usize, name)? as *mut c_void)
    }
    /// The variable `name` of the library, in the current context (as cuModuleGetGlobal_v2).
    fn cuLibraryGetGlobal(dptr: *mut CUdeviceptr, bytes: *mut usize, library: *mut c_void, name: *const c_char) {
        drv()?;
        let l = libraries().get(library as usize)?;
        get_global(dptr, bytes, l.module, name)
    }
    /// The kernel's function in the current context (cuda.h: "Returns in pFunc the handle of
    /// the function for the requested kernel kernel and the current context").
    fn cuKernelGetFunction(pfunc: *mut CUfunction, kernel: *mut c_void) {
        drv()?;
        let k = kernels().get(kernel as usize)?;
        ctx::current()?;
        write(pfunc, k.function as CUfunction)
    }
    /// The variable `name` of the module (see `module_global`).
    fn cuModuleGetGlobal_v2(dptr: *mut CUdeviceptr, bytes: *mut usize, module: CUmodule, name: *const c_char) {
        drv()?;
        get_global(dptr, bytes, module as usize, name)
    }
    fn cuFuncGetModule(module: *mut CUmodule, f: CUfunction) {
        drv()?;
        let func = functions().get(f as usize)?;
        write(module, func.module as CUmodule)
    }
}
