#include <posenc/posenc.h>

namespace posenc {

const char* version() { return POSENC_VERSION; }

}  // namespace posenc

extern "C" const char* posenc_version() { return posenc::version(); }
