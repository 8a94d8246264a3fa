// Placeholder until the CLI lands (src/cli).
#include <cstdio>
int main() { std::puts("dtrain " DTRAIN_VERSION); return 0; }
